package leader

import "context"

// GocronElector adapts an Elector to the distributed-elector interface of the
// job scheduler github.com/go-co-op/gocron/v2, without this module depending
// on gocron. That interface is
//
//	type Elector interface {
//		IsLeader(context.Context) error
//	}
//
// and an Elector cannot meet it directly, because its own IsLeader reports a
// bool. Wrap it:
//
//	e, err := leader.New(store, leader.Config{Name: "nightly-report"})
//	if err != nil {
//		return err
//	}
//	go e.Run(ctx)
//	s, err := gocron.NewScheduler(
//		gocron.WithDistributedElector(leader.GocronElector{Elector: e}),
//	)
//
// gocron asks IsLeader each time a job is due and runs the job only if it
// returns nil, so jobs run on whichever instance leads at that moment. A job
// that has started keeps running if leadership is lost while it runs; to stop
// it then, or to guard its writes with the fencing term, do its work inside
// Elector.RunIfLeader.
//
// The zero value is not usable: Elector must be set.
type GocronElector struct {
	// Elector is the Elector asked; its Run must be running for it to lead.
	Elector *Elector
}

// IsLeader returns nil if the Elector leads now and ErrNotLeader otherwise
// (see Elector.Check). It does not block and ignores ctx.
func (g GocronElector) IsLeader(ctx context.Context) error {
	return g.Elector.Check(ctx)
}

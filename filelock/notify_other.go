//go:build !linux

package filelock

import (
	"errors"
	"runtime"
)

// openNotifier fails: outside Linux, a Store learns of changes by polling.
func openNotifier(string) (*notifier, error) {
	return nil, errors.New("filelock: no file event notification on " + runtime.GOOS)
}

package faults_test

import (
	"testing"

	"github.com/leaderelect/leader/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

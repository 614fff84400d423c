//go:build linux || dragonfly || freebsd || illumos || netbsd || openbsd

package main

// defaultStoreDirHelp describes defaultStoreDir in help texts.
const defaultStoreDirHelp = "$XDG_STATE_HOME/leader (~/.local/state/leader)"

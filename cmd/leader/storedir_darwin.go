package main

// defaultStoreDirHelp describes defaultStoreDir in help texts: on macOS,
// filelock.DefaultDir is in os.UserConfigDir.
const defaultStoreDirHelp = "~/Library/Application Support/leader"

module github.com/leaderelect/leader

go 1.25

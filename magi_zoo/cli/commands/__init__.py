"""One module per `magi-zoo` command: `list`, `spec`, `demo`, `run` (with `run_options`, what
its flags become before anything is built) and `explain`. Each `cmd_<name>(args)` takes the
parsed arguments and returns the exit status."""

"""Entry points: ``python -m launch.cluster`` (:mod:`launch.cluster`) and the parts it wires."""

import signal

#: Exit code of a bad command line or config, or a launch refused before any worker starts.
EXIT_CONFIG = 2
#: ``status | head -1``: stdout's reader went away; what a shell reports for a process killed by SIGPIPE.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE

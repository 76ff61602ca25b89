"""Exit codes of the `diag` commands. The docs site's exit codes page is generated from this file,
each constant with its comment (a trailing one, else the lines just above it).

Kubeflow's `restartPolicy: ExitCode` treats 1-127 as permanent and 128-255 as retryable, so
codes that ask for a restart of the pod sit at 128 and above.
"""

OK = 0
FAILURE = 1  # an unexpected internal error (a bug: please report it with the log)
USAGE = 2  # bad flags, configuration or input; the message says what to change
HANG_DETECTED = 3  # `diag agent --until incident`: an incident was detected and handled
PRECHECK_FAULTY = 4  # `diag precheck`: faulty or straggling nodes were found
PRECHECK_ERROR = 5  # `diag precheck`: the check could not run (rendezvous failed, timeout)
DEMO_MISMATCH = 6  # `diag demo`: the verdict did not name the injected rank
KUBE_ERROR = 7  # `diag taint`/`untaint`: the Kubernetes API refused or could not be reached
DRAIN_INCOMPLETE = 8  # `diag agent`: a drain reached its deadline with something not persisted
INTERRUPTED = 130  # SIGINT
# What the agent's EXIT command asks a drained rank to leave with: 128 + SIGTERM, so that the
# launcher restarts it (diag.trainer.graceful.stopflag.DRAIN_EXIT_CODE, the same number).
RANK_DRAINED = 143


class UsageError(Exception):
    """Bad input from the user. The message must name the problem and what to do about it."""

"""The `diag` command line: every entry point in one place (`main` dispatches to a module per
subcommand, imported only when it runs, so `diag agent` never imports torch).

Owns: flags, usage errors and exit codes of each subcommand.
May import: anything in diag; nothing imports it.
"""

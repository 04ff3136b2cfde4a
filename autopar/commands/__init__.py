"""The ``autopar`` command line's commands, one module each (``plan_command``, ``train_command``,
…): a command module has ``add_parser(subs)``, which adds the command with its options, help and
examples, and ``run(args, console) -> int``, which does it and returns the exit status.
``autopar.cli`` assembles the parser from them and runs the one named.

Shared by the commands: ``options`` (the parser, value types and option groups), ``console``
(progress, warnings and errors on stderr), ``loading`` (the workload, cluster, configuration and
plan a command line names) and ``baselines`` (the other side of a comparison).
"""

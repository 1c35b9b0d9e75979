"""The driver side: a run from its config to its checkpoints, on a Ray cluster.

``cli`` and ``driver`` start a run; ``run_context`` holds its checks, folder, checkpoints and resume state,
``connection`` its Ray cluster; ``recipes`` declare each algorithm (its learner, roles, checks) and its step,
which ``step_loop`` runs. The subpackages: ``config`` (the schema and its loading), ``roles``
(starting, placing, syncing and restarting the roles), ``data`` (prompt sets and streams) and
``ops`` (metrics, console, trackers, telemetry, ledger, status). Roles' own code lives in
``actors/`` and ``learners/``; nothing there imports from here.
"""

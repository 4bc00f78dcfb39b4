"""The training program, ``python -m jamp.train``: the library's first client.

Built only from the library (``jamp``) plus data, models, checkpoints and logging: ``cli`` reads
the command line and the recipe, ``run_config`` checks it, ``loop`` wires the parts and runs the
steps, ``run_log`` tells the user what happens, ``checkpoint``, ``metrics``, ``optim``, ``tasks``,
``overflow_watch`` and ``data`` are its parts. Nothing in the library imports this package.
"""

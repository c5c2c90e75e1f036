"""The processes of a training run: the control-plane messages (``messages``) and sockets
(``control``), the coordinator's busy loop (``coordinator``) over its parts (``work``,
``assignment``, ``ledger``, ``restarts``, ``stopping``, ``run_metrics``, ``commands``), and the
worker roles (``base``, ``target``, ``drafter``), and the supervisor that starts, watches and stops
worker processes (``supervisor``, shared by training and regeneration)."""

"""``gradbed torchrun``: a user's unmodified ``torch.distributed`` script on the emulated
hosts, launched by real ``torchrun`` (``python -m torch.distributed.run``) in each host.

- :mod:`controller.roles.torchrun` (pure): which hosts train, each host's command line and environment (the
  variables that keep gloo, TensorPipe and NCCL on the emulated interface), the store
  timeouts scaled to the configured delay and loss;
- :mod:`.sockdiag`: the ranks' TCP connections read with sock_diag from outside the
  processes, in each host's namespace, including each connection's last counters when
  the kernel destroys it;
- :mod:`.proof` (pure): the bytes the collectives must have moved, against what the
  connections and the interfaces carried;
- :mod:`.experiment`: the run itself (the builder, driver and run directory of
  ``controller.run``), and :mod:`.cli` the command line.

See docs/torchrun.md.
"""

"""The pure core every package may import: config types, policies, registries, the event schema.

Nothing here starts a process, opens a socket or touches the network; nothing here imports
``controller``, ``topo``, ``traces``, ``analysis`` or the rest of ``agents``.
"""

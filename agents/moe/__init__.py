"""Mixture of experts over the emulated network (DESIGN.md section 1.4, seeds/002).

One file per algorithm:
- :mod:`agents.moe.gate`      the gate ``softmax(x W_g)`` and top-k choice
- :mod:`agents.moe.capacity`  expert capacity and the two drop policies
- :mod:`agents.moe.aux_loss`  the load-balancing auxiliary loss
- :mod:`agents.moe.combine`   dispatch into per-expert buffers and the gate-weighted combine
- :mod:`agents.moe.residual`  residual MoE (a dense branch mixed by learned coefficients)
- :mod:`agents.moe.layer`     the MoE layer built from the above (experts local or remote)
- :mod:`agents.moe.offload`   Belady and LRU parameter offload into a device budget
- :mod:`agents.moe.exchange`  the two-phase all-to-all as a sans-I/O state machine
- :mod:`agents.moe.zero`      parameter classes and ZeRO-2/3 sharded optimizer state
"""

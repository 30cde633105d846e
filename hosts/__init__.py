"""Host agents: the gradient transport and ring all-reduce inside PyTorch DDP.

Workers put fully reduced gradients on the wire once, tagged REPLICATE, so the
switch can copy them to shadows (filled by the host-agent issue).
"""

"""Shadow nodes: reassemble copied gradients, apply the optimizer, checkpoint.

(Filled by the shadow-node issue.)
"""

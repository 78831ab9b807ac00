"""dflash.drafter: the DFlash drafter and what it eats: the model, its packed input layout, attention masks and
kernels, and the drafter's folder format.

It imports neither storage/, train/ nor targets/ (it runs no target), so eval, export, the demo, decoding and the
benchmarks use it without the training loop.
"""

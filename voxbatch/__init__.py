"""voxbatch: distributed batch text-to-speech (CosyVoice2 on GPU workers, Redis job queue, S3 output).

The modules directly in this package are the contract both sides share; `voxbatch.producer` runs on
CPUs without torch, `voxbatch.worker` on the GPUs; neither imports the other (see docs/design.md).
"""

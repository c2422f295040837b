"""voxbatch's own CosyVoice2 inference: loads an official model directory unchanged, runs in batches."""

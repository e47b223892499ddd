"""msakit: MiniMax-M3.1-Flash's system (MSA sparse attention with a KL-trained block indexer,
NVFP4/MXFP8 quantization-aware training, DSpark speculative decoding), fast on Hopper GPUs."""

__version__ = "0.1.0"

"""DeepSeek-V4 sparse decode through FlashMLA (vLLM 0.33, CUDA): the c4a block layout
FlashMLA reads, and a torch reference of its V4 sparse decode.  Imports torch only."""

"""The model's pieces: loading, attention masks and kernels, chunked loss, activation
checkpointing, the layer-scan choice."""

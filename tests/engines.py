"""Engine settings every test engine and test server shares (small, fp32, eager)."""

ENGINE_DEFAULTS = dict(
    dtype="float32",
    max_model_len=512,
    gpu_memory_utilization=0.3,
    kv_cache_memory_bytes=512 * 1024 * 1024,
    max_num_seqs=16,
    enforce_eager=True,
)

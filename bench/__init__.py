"""``paged-bench``: paired measurements of paged-decode against the bandwidth floor, llama.cpp and
HF transformers.  Imports both the build side and the runtime; neither imports it."""

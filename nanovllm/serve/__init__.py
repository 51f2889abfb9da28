"""An OpenAI-compatible HTTP server over one engine: `nanovllm serve MODEL` or `python -m nanovllm.serve`.

engine_loop.py  the thread that owns the engine: admits requests between steps, steps, publishes
protocol.py     OpenAI request bodies -> SamplingParams; responses, stream chunks and errors
app.py          the FastAPI routes (/v1/completions, /v1/chat/completions, /v1/models, /health)
cli.py          the command line (the LLM options as flags) and uvicorn
"""

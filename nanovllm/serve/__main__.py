from nanovllm.serve.cli import serve

serve()

from nanovllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: the Llama decoder with a per-head RMSNorm on q and k before rotary (no QKV bias
    unless the config's attention_bias says so)."""
    qk_norm = True

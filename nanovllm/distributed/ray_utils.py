"""Importing and starting Ray, with errors that say what to install."""

import nanovllm.envs as envs
from nanovllm.utils.processes import child_pythonpath

RAY_EXTRA_HINT = "pip install 'nanovllm[ray]' (or: pip install 'ray[data]')"


def import_ray():
    """The ray module, or an ImportError that names the extra to install."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"this needs Ray, which is not installed: {RAY_EXTRA_HINT}") from e
    return ray


def init_ray(**ray_init_kwargs) -> bool:
    """Connect to the cluster at RAY_ADDRESS when it is set, else start a local one; nothing when Ray
    is already initialized. Returns whether this call started the session (its owner shuts it down)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    if not envs.RAY_ADDRESS.get():
        # A local cluster's workers import the same nanovllm as this process (not another install).
        ray_init_kwargs.setdefault("runtime_env", {"env_vars": {"PYTHONPATH": child_pythonpath()}})
    ray.init(**ray_init_kwargs)
    return True


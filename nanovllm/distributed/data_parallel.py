"""Data parallelism on Ray: N engine replicas, each a Ray actor holding its tensor-parallel GPUs on
one node (a placement group per replica). A job's prompts are balanced over the replicas by the
tokens they will compute and read, and its outputs returned in prompt order; a replica that dies has its
unfinished prompts re-run on the live ones."""
import contextlib
import os
import re
import time
from collections import deque
from dataclasses import dataclass

from nanovllm.config import Config
from nanovllm.distributed.ray_utils import import_ray, init_ray
from nanovllm.engine.generation_defaults import default_sampling_overrides
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.requests import (as_prompt_list, check_priority, lora_per_prompt,
                                      sampling_params_list, unwrap_prompt_dict)
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.balance import assign_by_cost, request_cost
from nanovllm.utils.hf_files import load_tokenizer

PLACEMENT_TIMEOUT_S = 300        # how long a replica may wait for its GPUs before start-up fails
CALLS_IN_FLIGHT = 2              # per replica: the next chunk is queued while one runs


@dataclass
class ReplicaInfo:
    """What a started replica tells the driver."""
    pid: int
    startup_s: float            # seconds its engine took to start
    config: Config              # its engine's (every replica's is the same)
    eos_token_ids: set[int]


class _Replica:
    """One engine in a Ray actor process (made a remote class when Ray is imported)."""

    def __init__(self, model: str, options: dict):
        t = time.perf_counter()
        self.engine = LLMEngine(model, **options)
        self.engine_startup_s = time.perf_counter() - t

    def ready(self) -> ReplicaInfo:
        return ReplicaInfo(os.getpid(), self.engine_startup_s, self.engine.config, self.engine.eos_token_ids)

    def generate(self, prompts: list, params: list[SamplingParams],
                 loras: list | None = None) -> tuple[list[RequestOutput], float]:
        """The outputs, and the seconds the engine's generate took (to tell the driver's overhead apart)."""
        t = time.perf_counter()
        outputs = self.engine.generate(prompts, params, use_tqdm=False, lora_request=loras)
        return outputs, time.perf_counter() - t

    def prompt_token_ids(self, prompts: list) -> list[list[int]]:
        return self.engine.prompt_token_ids(prompts)

    def shutdown(self):
        self.engine.shutdown()


@dataclass
class _Chunk:
    indices: list[int]     # the job's prompt indices, ascending
    cost: int              # estimated work (see DataParallelEngine._cost)


@dataclass
class JobTiming:
    """Where the last generate's wall time went, as the driver saw it (keys are replica numbers)."""
    wall_s: float                     # the driver's generate call, end to end
    split_s: float                    # estimating the prompts' costs and splitting them
    shares: dict[int, list[int]]      # the job's prompt indices each replica returned outputs for
    engine_s: dict[int, float]        # seconds inside each replica's engine (its generate calls, summed)
    done_s: dict[int, float]          # from the job's start until the driver held the replica's last outputs

    @property
    def overhead_s(self) -> float:
        """Wall time beyond the slowest replica's engine: splitting, Ray calls, moving prompts and outputs."""
        return self.wall_s - max(self.engine_s.values(), default=0.0)


class DataParallelEngine:
    """The engine of `LLM(model, data_parallel_size=N, **options)` with N > 1: LLMEngine's generate /
    get_tokenizer / get_default_sampling_params / shutdown (and what LLM's chat and beam_search
    need), over N engine replicas on a Ray cluster (RAY_ADDRESS, else a local one). Every option but
    data_parallel_size goes to each replica's engine."""

    requests_per_call = 1024     # a replica's share is sent in chunks of this many prompts

    def __init__(self, model: str, data_parallel_size: int = 2, **options):
        check_data_parallel_size(data_parallel_size)
        ray = import_ray()
        # On the driver as in each replica's engine (Config.create): options checked by name, so a typo
        # fails before any replica starts; a hub id downloaded here (and on each node), at the revision
        # asked; the tokenizer the engines use renders chats here.
        # (data_parallel_size is this call's own argument: named only in the listing of valid options)
        self.model, tokenizer = Config.resolve(model, options, also_valid=("data_parallel_size",))
        self.tokenizer = None if options.get("skip_tokenizer_init") else load_tokenizer(
            tokenizer or self.model, options.get("tokenizer_mode", "auto"))
        self.default_sampling_overrides = default_sampling_overrides(
            self.model, options.get("generation_config", "auto"))
        self.startup_seconds: dict[str, float] = {}   # phase -> seconds, for logs and bench.py
        started = time.perf_counter()
        self._owns_ray = init_ray()
        self.startup_seconds["ray_init"] = time.perf_counter() - started
        tp = options.get("tensor_parallel_size", 1)
        bundle = _replica_bundle(ray, tp, options.get("device", "auto"))
        _check_cluster_fits(ray, bundle, data_parallel_size)
        self.placement_groups = [ray.util.placement_group([bundle], strategy="STRICT_PACK")
                                 for _ in range(data_parallel_size)]
        self.replicas = [self._start_replica(ray, pg, bundle, options) for pg in self.placement_groups]
        self.live = list(range(data_parallel_size))
        try:
            ready = ray.get([r.ready.remote() for r in self.replicas])   # the replicas start in parallel
        except BaseException:
            self.shutdown()
            raise
        self.replica_pids = [info.pid for info in ready]
        # replicas: placing and starting all of them (a Ray worker process each, importing nanovllm,
        # then its engine); engine: the slowest replica's engine start-up alone
        self.startup_seconds["replicas"] = time.perf_counter() - started - self.startup_seconds["ray_init"]
        self.startup_seconds["engine"] = max(info.startup_s for info in ready)
        self.config, self.eos_token_ids = ready[0].config, ready[0].eos_token_ids
        self.completed_requests = 0   # of the running job; another thread may read it
        self.rerun_requests = 0       # prompts re-run because their replica died (all jobs)
        self.last_job: JobTiming | None = None

    def _start_replica(self, ray, pg, bundle: dict, options: dict):
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise RuntimeError(f"a replica's placement group {bundle} was not placed within "
                               f"{PLACEMENT_TIMEOUT_S}s; free resources: "
                               f"{ray.available_resources()}") from None
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        actor = ray.remote(_Replica).options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0))
        return actor.remote(self.model, options)

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """As one engine's: SamplingParams with the model's generation_config.json settings."""
        return SamplingParams(**self.default_sampling_overrides)

    def one_call(self):
        """Nothing to hold: the driver keeps no state a call needs alone, and each replica's engine
        serves its calls one at a time."""
        return contextlib.nullcontext()

    def prompt_token_ids(self, prompts) -> list[list[int]]:
        """Each prompt's token ids, checked by a live replica's engine as it checks a job's."""
        ray, prompts = import_ray(), as_prompt_list(prompts)
        self._check_live()
        try:
            return ray.get(self.replicas[self.live[0]].prompt_token_ids.remote(prompts))
        except Exception as e:
            raise _with_job_indices(e, list(range(len(prompts)))) from e

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None, priority=None) -> list[RequestOutput]:
        self._check_live()
        started = time.perf_counter()
        prompts = as_prompt_list(prompts)
        check_priority(priority, len(prompts))
        # one SamplingParams and one LoRARequest (or None) per prompt (each replica checks their
        # values, and each adapter's folder, as one engine does)
        params = sampling_params_list(sampling_params, len(prompts), self.get_default_sampling_params)
        loras = lora_per_prompt(lora_request, len(prompts), self.config.enable_lora)
        costs = [self._cost(p, sp) for p, sp in zip(prompts, params)]
        queues = {r: deque(self._chunks(share, costs))
                  for r, share in zip(self.live, assign_by_cost(costs, len(self.live)))}
        timing = JobTiming(0.0, time.perf_counter() - started, {r: [] for r in queues},
                           {r: 0.0 for r in queues}, {r: 0.0 for r in queues})
        outputs = self._run(queues, prompts, params, loras if any(loras) else None,
                            _progress(len(prompts), use_tqdm), timing, started)
        for i, out in enumerate(outputs):
            out.request_id = str(i)   # replicas number their requests independently
        timing.wall_s = time.perf_counter() - started
        self.last_job = timing
        return outputs

    def _check_live(self):
        if not self.live:
            raise RuntimeError("every data-parallel replica has died (or was shut down); start a new LLM")

    def _cost(self, prompt, params: SamplingParams) -> int:
        """The work a request will cost, as far as known beforehand (max_tokens outputs), in tokens:
        see request_cost. It counts the K/V each decode step reads, most of a step's time: balancing
        prompt + output tokens instead left one replica 5% more to read on bench.py's workload."""
        prompt = unwrap_prompt_dict(prompt, "")
        if isinstance(prompt, str):
            n = len(self.tokenizer.encode(prompt)) if self.tokenizer else len(prompt.split())
        else:
            n = len(prompt) if isinstance(prompt, (list, tuple)) else 1
        return request_cost(n, params.max_tokens or n) * params.n

    def _chunks(self, indices: list[int], costs: list[int]) -> list[_Chunk]:
        size = self.requests_per_call
        return [_Chunk(part, sum(costs[i] for i in part))
                for part in (indices[k:k + size] for k in range(0, len(indices), size))]

    def _run(self, queues: dict[int, deque], prompts: list, params: list, loras: list | None, bar,
             timing: JobTiming, started: float) -> list[RequestOutput]:
        """Keep CALLS_IN_FLIGHT chunks on each live replica until every chunk has its outputs."""
        ray = import_ray()
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        in_flight: dict = {}   # ObjectRef -> (replica, chunk)
        self.completed_requests = 0
        try:
            while True:
                for r in self.live:
                    while queues[r] and sum(v[0] == r for v in in_flight.values()) < CALLS_IN_FLIGHT:
                        chunk = queues[r].popleft()
                        ref = self.replicas[r].generate.remote(
                            [prompts[i] for i in chunk.indices], [params[i] for i in chunk.indices],
                            loras and [loras[i] for i in chunk.indices])
                        in_flight[ref] = (r, chunk)
                if not in_flight:
                    break
                [ref], _ = ray.wait(list(in_flight), num_returns=1)
                r, chunk = in_flight.pop(ref)
                try:
                    results, engine_s = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._replica_died(r, chunk, queues, e)
                    continue
                except Exception as e:
                    raise _with_job_indices(e, chunk.indices) from e
                for i, out in zip(chunk.indices, results):
                    outputs[i] = out
                timing.shares.setdefault(r, []).extend(chunk.indices)
                timing.engine_s[r] = timing.engine_s.get(r, 0.0) + engine_s
                timing.done_s[r] = time.perf_counter() - started
                self.completed_requests += len(chunk.indices)
                bar.update(len(chunk.indices))
        finally:
            bar.close()
            for ref in in_flight:   # an error ended the job: drop the rest of it
                ray.cancel(ref)
        assert all(o is not None for o in outputs)
        return outputs

    def _replica_died(self, r: int, chunk: _Chunk, queues: dict[int, deque], error: Exception):
        """Move the dead replica's chunk and its queue to the live replicas with the least work."""
        if r in self.live:
            self.live.remove(r)
        orphans = [chunk, *queues.pop(r, ())]
        if not self.live:
            left = sum(len(c.indices) for c in orphans)
            raise RuntimeError(f"every data-parallel replica has died; {left} prompts of this job were "
                               f"left unfinished (last error: {error})") from error
        for c in orphans:
            least = min(self.live, key=lambda q: sum(x.cost for x in queues[q]))
            queues[least].append(c)
            self.rerun_requests += len(c.indices)

    def shutdown(self):
        """Stop the replicas and free their placement groups (and the local Ray session it started)."""
        ray = import_ray()
        for actor in getattr(self, "replicas", []):
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception:
                pass   # already dead, or stuck: killed below
            ray.kill(actor)
        self.replicas, self.live = [], []
        for pg in getattr(self, "placement_groups", []):
            ray.util.remove_placement_group(pg)
        self.placement_groups = []
        if getattr(self, "_owns_ray", False):
            ray.shutdown()
            self._owns_ray = False


def check_data_parallel_size(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"data_parallel_size must be an integer >= 1, got {value!r}")


def _replica_bundle(ray, tp: int, device: str) -> dict:
    """A replica's resources, in one bundle, so that the actor and the tensor-parallel workers it
    spawns see exactly these GPUs (CUDA_VISIBLE_DEVICES), all on one node."""
    use_gpu = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    return {"CPU": 1, "GPU": tp} if use_gpu else {"CPU": tp}


def _check_cluster_fits(ray, bundle: dict, replicas: int):
    """Fail at once (not after a placement timeout) when the nodes cannot hold the replicas."""
    fit = 0
    for node in ray.nodes():
        if node.get("Alive"):
            have = node.get("Resources", {})
            fit += min(int(have.get(k, 0) // v) for k, v in bundle.items() if v)
    if fit < replicas:
        raise ValueError(f"data_parallel_size={replicas} needs {replicas} x {bundle} with each replica on "
                         f"one node, but the Ray cluster's nodes hold only {fit} "
                         f"(cluster: {ray.cluster_resources()})")


_PROMPT_INDEX = re.compile(r"^(prompt|sampling_params|lora_request) (\d+)")


def _with_job_indices(error: Exception, indices: list[int]) -> Exception:
    """A replica's validation error names the prompt's index in its chunk; name the job's index.
    Other errors pass unchanged."""
    cause = getattr(error, "cause", None) or error   # a RayTaskError wraps the replica's exception
    if not isinstance(cause, (ValueError, TypeError)):
        return error
    message = _PROMPT_INDEX.sub(lambda m: f"{m[1]} {indices[int(m[2])]}", str(cause))
    return type(cause)(message)


def _progress(total: int, use_tqdm: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="Generating", dynamic_ncols=True, disable=not use_tqdm)

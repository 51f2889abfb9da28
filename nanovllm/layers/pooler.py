"""Pooling prompt-only steps. A prompt may be computed in several chunks (chunked prefill), so each
step gives each sequence only its chunk's share of the output (pool_step, on the device, inside the
model's step on every rank; rank 0's are kept), and the sequence's SequencePooling gathers the shares
as each step is launched, in step order (start_pooled); the step that computes its last chunk
finishes it (finish_all: Matryoshka cut, normalisation, activation) and copies the output to the
host behind it (PendingPooled, waited for with the step's other results).

Pooling methods: LAST (the last prompt token's hidden state: decoders' default), CLS (the first),
MEAN (over every prompt token) and ALL (every token: the token-wise tasks). Only LAST may read a
cached prefix: the others need the hidden states of every prompt position."""
import torch
import torch.nn.functional as F

from nanovllm.pooling_params import PoolingParams

ONE_ROW = ("LAST", "CLS")
TOKEN_WISE = ("token_embed", "token_classify")


class SequencePooling:
    """One pooling request's settings, and what its chunks pooled so far, on its Sequence."""

    def __init__(self, params: PoolingParams, method: str):
        self.params = params              # resolved for its task (PoolingParams.resolved)
        self.method = method              # LAST, CLS, MEAN or ALL
        self.num_tokens = 0               # prompt tokens pooled so far
        self.partial: torch.Tensor | None = None   # [1, D] (LAST, CLS; MEAN: fp32 sum) or [n, D] (ALL)
        self.data: torch.Tensor | None = None      # the output, on the host, once the last chunk is in

    @property
    def reads_every_position(self) -> bool:
        return self.method != "LAST"

    def add(self, share: torch.Tensor | None, n: int):
        """One chunk's share (pool_step), in step order; n: its tokens."""
        self.num_tokens += n
        if share is None:
            return
        if self.partial is None or self.method in ONE_ROW:
            self.partial = share
        elif self.method == "MEAN":
            self.partial = self.partial + share
        else:
            self.partial = torch.cat([self.partial, share])

    def pooled(self) -> torch.Tensor:
        """[D] for the sequence-wise methods, [num_tokens, D] for ALL (fp32, on the device)."""
        x = self.partial.float()
        if self.method == "MEAN":
            return x[0] / self.num_tokens
        return x if self.method == "ALL" else x[0]


def rows_read(method: str, start: int, n: int, final: bool) -> tuple[int, int] | None:
    """The rows of a chunk of n prompt tokens from position `start` that a pooling method reads."""
    if method == "LAST":
        return (n - 1, n) if final else None
    if method == "CLS":
        return (0, 1) if start == 0 else None
    return 0, n


def pool_step(hidden: torch.Tensor, step, head) -> list[torch.Tensor | None]:
    """hidden: [num_tokens, hidden] of a prompt-only step (a StepInput with `pooling`), its sequences'
    chunks one after another -> per sequence its chunk's share of the output (None: none): the rows
    its method reads, through the score head when the model has one (it is linear: the mean of its
    outputs is its output of the mean), summed in fp32 for MEAN."""
    shares: list[torch.Tensor | None] = [None] * len(step.starts)
    picked, first = [], 0   # (sequence, row) of the one-row methods, gathered in one index_select
    for i, (start, ids, (method, final)) in enumerate(zip(step.starts, step.token_ids, step.pooling)):
        span = rows_read(method, start, len(ids), final)
        if span is not None:
            lo, hi = first + span[0], first + span[1]
            if method in ONE_ROW:
                picked.append((i, lo))
            else:
                rows = hidden[lo:hi] if head is None else head(hidden[lo:hi])
                shares[i] = rows.float().sum(0, keepdim=True) if method == "MEAN" else rows.clone()
        first += len(ids)
    if picked:
        index = torch.tensor([row for _, row in picked], dtype=torch.int64, device=hidden.device)
        rows = hidden.index_select(0, index)
        rows = rows if head is None else head(rows)
        for j, (i, _) in enumerate(picked):
            shares[i] = rows[j:j + 1]
    return shares


def finish_all(poolings: list[SequencePooling]) -> list[tuple[list[SequencePooling], torch.Tensor]]:
    """The outputs of the sequences whose last chunk is in, on the device: (members, their outputs
    stacked [k, ...]) for each group of sequence-wise ones with the same settings, post-processed
    together; a token-wise one alone ([1, num_tokens, D])."""
    groups: dict[tuple, list[SequencePooling]] = {}
    out = []
    for p in poolings:
        if p.params.task in TOKEN_WISE:
            out.append(([p], post_process(p.pooled(), p.params)[None]))
        else:
            key = (p.params.task, p.params.dimensions, p.params.normalize, p.params.use_activation)
            groups.setdefault(key, []).append(p)
    for members in groups.values():
        stacked = torch.stack([p.pooled() for p in members])   # [k, D]
        out.append((members, post_process(stacked, members[0].params)))
    return out


def post_process(x: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """x: [..., D] fp32. Embeddings: the first `dimensions` (Matryoshka), then unit L2 norm;
    classifier logits: softmax over the labels (sigmoid for a single label)."""
    if params.task in ("embed", "token_embed"):
        if params.dimensions is not None:
            x = x[..., :params.dimensions]
        return F.normalize(x, p=2, dim=-1) if params.normalize else x
    if params.use_activation:
        return torch.sigmoid(x) if x.shape[-1] == 1 else torch.softmax(x, dim=-1)
    return x


class PendingPooled:
    """The outputs a launched prompt-only step finishes, on their way to the host: the copies are
    queued right behind the step (into pinned memory), as the sampled tokens' are."""

    def __init__(self, groups: list[tuple[list[SequencePooling], torch.Tensor]]):
        self.groups = [(members, data.to("cpu", non_blocking=True)) for members, data in groups]
        self.event = None
        if groups and groups[0][1].is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def finish(self):
        """Wait for the copies; each finished sequence's SequencePooling gets its data."""
        if self.event is not None:
            self.event.synchronize()
        for members, data in self.groups:
            for pooling, row in zip(members, data):
                pooling.data = row


def start_pooled(batch, shares: list[torch.Tensor | None]) -> PendingPooled:
    """Right after a prompt-only step is launched (rank 0): add each sequence's share (device work,
    in stream order, so a later chunk's step may launch before this one's results are on the host),
    and queue the outputs of the sequences whose last chunk this step computes and their copies to
    the host. A sequence finished meanwhile (aborted) is skipped."""
    done = []
    for seq, n, share, final in zip(batch.seqs, batch.num_new_tokens, shares, batch.pools):
        if seq.is_finished:
            continue
        seq.pooling.add(share, n)
        if final:
            done.append(seq.pooling)
    return PendingPooled(finish_all(done))

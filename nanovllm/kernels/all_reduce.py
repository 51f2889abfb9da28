"""A one-shot all-reduce over peer GPU memory, for the decode-sized tensors of tensor parallelism.

A decode step's sums are small (256 x 4096 bf16: 2 MB, a few microseconds over NVLink) and many
(72 a step for Qwen3-8B), so latency decides; NCCL's took roughly 8-12 us each inside the TP=2
decode graphs on two H200s. Here each rank owns a buffer that every other rank maps (CUDA IPC),
and one kernel does the whole all-reduce:

  1. push: every program copies its slices of this rank's partial sum into this rank's slot of
     each peer's buffer (plain stores over NVLink);
  2. signal: each program writes the call's epoch into its flag on every peer (a system-scope
     release, after a block barrier), then spins until every peer's flag for it reached the epoch
     (an acquire);
  3. sum: the program adds its slices of every rank's partial, in rank order (so every rank gets
     the same bits), in fp32, and writes the result over its input.

The grid is always PROGRAMS programs (all resident at once), and program p always handles the same
slices, so both ranks' program p meet each call. Each program keeps its own epoch counter on the
device (CUDA graphs replay the kernel with the same arguments); its flags only grow, so a peer
that is already a call ahead cannot be missed. Buffers alternate between two halves by the epoch's
parity: a rank writes half h of call k+2 only after it saw every peer's signal of call k+1, which
each peer sent after its call k (which read half h) had finished: no overwrite of unread data.

A spin also reads an abort word in pinned host memory every ABORT_POLL spins: when a peer dies,
abort_tp_group sets it and the kernel ends (with garbage) instead of holding the GPU forever.

The Triton interpreter runs it too (tests/test_all_reduce.py: two and three ranks as processes over
shared host buffers), so the protocol is tested on CPU."""
import ctypes

import torch
import triton
import triton.language as tl

from nanovllm.kernels.common import interpreted, rounded

# A decode step's 2 MB in two iterations of every program, each thread's four 16-byte loads in
# flight at once (the loops are not pipelined: fewer, wider iterations hide the latency).
PROGRAMS = 128          # the kernel's grid: all resident at once (a few registers, no shared memory)
MAX_PROGRAMS = 256      # flags per rank in a buffer (a grid of up to this many programs)
BLOCK = 4096            # elements a program moves per iteration (32 per thread, 4 warps)
ABORT_POLL = 256        # spins between two reads of the abort word (a PCIe read: about 1 us)
SLOT_BYTES = 8 << 20    # one launch's most bytes (a decode step of 512 x 8192 bf16); larger in chunks


@triton.jit(do_not_specialize=["n"])
def _peer_all_reduce_kernel(x_ptr, n, addrs_ptr, epochs_ptr, abort_ptr, RANK: tl.constexpr,
                            WORLD: tl.constexpr, SLOT: tl.constexpr, FLAGS_AT: tl.constexpr,
                            PROGRAMS: tl.constexpr, MAX_PROGRAMS: tl.constexpr, BLOCK: tl.constexpr,
                            ABORT_POLL: tl.constexpr, INTERPRETED: tl.constexpr):
    # addrs_ptr: each rank's buffer address (int64), rank order: [2 halves][WORLD slots][SLOT
    # elements], then WORLD x MAX_PROGRAMS int64 flags from element FLAGS_AT (in int64 units).
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    epoch = tl.load(epochs_ptr + pid) + 1
    half = (epoch % 2) * (WORLD * SLOT)
    span = PROGRAMS * BLOCK
    # 1. push. (Triton 3.6's interpreter cannot run range() over a program id's bounds under
    # numpy 2: it loops with while there; the compiled kernel keeps its for loops.)
    if INTERPRETED:
        start = pid * BLOCK
        while start < n:
            _push(x_ptr, addrs_ptr, start, n, half, RANK, WORLD, SLOT, BLOCK)
            start += span
    else:
        for start in range(pid * BLOCK, n, span):
            _push(x_ptr, addrs_ptr, start, n, half, RANK, WORLD, SLOT, BLOCK)
    tl.debug_barrier()                                              # 2. signal, then wait
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer_flags = tl.load(addrs_ptr + r).to(tl.pointer_type(tl.int64)) + FLAGS_AT
            tl.atomic_xchg(peer_flags + RANK * MAX_PROGRAMS + pid, epoch, sem="release", scope="sys")
    own = tl.load(addrs_ptr + RANK)
    own_flags = own.to(tl.pointer_type(tl.int64)) + FLAGS_AT
    for r in tl.static_range(WORLD):
        if r != RANK:
            flag = own_flags + r * MAX_PROGRAMS + pid
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            spins = 0
            aborted = 0
            while (seen < epoch) & (aborted == 0):
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                spins += 1
                if spins % ABORT_POLL == 0:
                    aborted = tl.load(abort_ptr, volatile=True)
    tl.debug_barrier()
    own_buf = own.to(tl.pointer_type(dtype)) + half
    if INTERPRETED:                                                 # 3. sum, in rank order
        start = pid * BLOCK
        while start < n:
            _sum(x_ptr, own_buf, start, n, RANK, WORLD, SLOT, BLOCK)
            start += span
    else:
        for start in range(pid * BLOCK, n, span):
            _sum(x_ptr, own_buf, start, n, RANK, WORLD, SLOT, BLOCK)
    tl.store(epochs_ptr + pid, epoch)


@triton.jit
def _push(x_ptr, addrs_ptr, start, n, half, RANK: tl.constexpr, WORLD: tl.constexpr, SLOT: tl.constexpr,
          BLOCK: tl.constexpr):
    """This rank's partial [start, start + BLOCK) into its slot of every peer's buffer."""
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer = tl.load(addrs_ptr + r).to(tl.pointer_type(x_ptr.dtype.element_ty))
            tl.store(peer + half + RANK * SLOT + offs, x, mask=mask)


@triton.jit
def _sum(x_ptr, own_buf, start, n, RANK: tl.constexpr, WORLD: tl.constexpr, SLOT: tl.constexpr,
         BLOCK: tl.constexpr):
    """Every rank's partial [start, start + BLOCK) added in rank order in fp32, over x's."""
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            part = tl.load(x_ptr + offs, mask=mask)
        else:
            part = tl.load(own_buf + r * SLOT + offs, mask=mask, cache_modifier=".cg")
        acc += part.to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(x_ptr + offs, rounded(acc, dtype).to(dtype), mask=mask)


class PeerAllReduce:
    """One rank's side: the address of every rank's buffer (the peers' mapped here), the
    per-program epochs and the abort word. `fits(x)` says whether it should reduce x (up to
    max_bytes: by default one launch); `x = ar(x)` reduces in place, a tensor larger than a slot in
    slot-sized chunks (every rank must call it with the same shapes in the same order, as with
    NCCL). Make one with connect() (CUDA IPC between processes) or from buffers every rank can
    address (the interpreter's test: host memory shared by processes). programs and block (the
    grid, and the elements a program moves per iteration) are fixed for its life. close() (or
    garbage collection) unmaps the peers' buffers and frees this rank's."""

    def __init__(self, rank: int, addresses: list[int], device: torch.device, slot_bytes: int = SLOT_BYTES,
                 programs: int = PROGRAMS, block: int = BLOCK, release=None):
        assert programs <= MAX_PROGRAMS
        self.rank, self.world, self.device, self.slot_bytes = rank, len(addresses), device, slot_bytes
        self.programs, self.block, self.max_bytes = programs, block, slot_bytes
        self.addrs = torch.tensor(addresses, dtype=torch.int64, device=device)
        self.epochs = torch.zeros(programs, dtype=torch.int64, device=device)
        self.abort_word = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._release = release
        self.interpreted = interpreted(device)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.device == self.device and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
                and x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        slot = self.slot_bytes // x.element_size()
        flat = x.view(-1)
        for start in range(0, flat.numel(), slot):
            chunk = flat[start:start + slot]
            _peer_all_reduce_kernel[(self.programs,)](
                chunk, chunk.numel(), self.addrs, self.epochs, self.abort_word, RANK=self.rank,
                WORLD=self.world, SLOT=slot, FLAGS_AT=2 * self.world * self.slot_bytes // 8,
                PROGRAMS=self.programs, MAX_PROGRAMS=MAX_PROGRAMS, BLOCK=self.block,
                ABORT_POLL=ABORT_POLL, INTERPRETED=self.interpreted, num_warps=4)
        return x

    def abort(self):
        """End every spinning kernel (a peer is gone): they return garbage from then on. A plain
        store to host memory: no driver call, so a thread can do it while another is stuck in one."""
        self.abort_word[0] = 1

    def close(self):
        release, self._release = self._release, None
        if release is not None:
            release()

    def __del__(self):
        self.close()

    @classmethod
    def connect(cls, rank: int, world: int, device: torch.device, exchange, **options) -> "PeerAllReduce":
        """Allocate this rank's buffer on `device` (outside torch's caching allocator: the peers
        write into it, so it must never be handed to another tensor while they can), share it with
        the other ranks through CUDA IPC and map theirs. exchange(payload: bytes) -> every rank's
        payload in rank order (through the group's store). Driver calls through ctypes: torch's own
        IPC (torch.multiprocessing) keeps reference counts in /dev/shm files, which a killed process
        would leave behind."""
        cuda, own, opened, handle = None, None, [], b""
        try:   # a rank that fails here still takes part in the exchange: the others must not wait
            cuda = _Driver()
            nbytes = buffer_bytes(world, options.get("slot_bytes", SLOT_BYTES))
            own = cuda.alloc(nbytes)
            cuda.zero(own, nbytes)   # the flags start at 0 before any peer can write them
            handle = cuda.ipc_handle(own)
        except (RuntimeError, OSError) as e:   # OSError: no libcuda
            error = e
        handles = exchange(handle)
        try:
            if not handle:
                raise error
            if not all(handles):
                raise RuntimeError("another rank could not allocate or share its all-reduce buffer")
            addresses = []
            for r, peer_handle in enumerate(handles):
                if r != rank:
                    opened.append(cuda.ipc_open(peer_handle))
                addresses.append(own if r == rank else opened[-1])
        except BaseException:
            if cuda is not None:
                cuda.release(own, opened)
            raise
        return cls(rank, addresses, device, release=lambda: cuda.release(own, opened), **options)


class _IpcHandle(ctypes.Structure):
    """CUipcMemHandle: 64 opaque bytes, passed by value (a ctypes array would go as a pointer)."""
    _fields_ = [("bytes", ctypes.c_ubyte * 64)]


class _Driver:
    """The few CUDA driver calls the buffers need (libcuda, in the calling thread's context: the
    device's primary context, which torch made current)."""
    LAZY_ENABLE_PEER_ACCESS = 1   # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def call(self, name: str, *args):
        """name: the exported symbol, as cuda.h's #defines pick it (cuMemAlloc is cuMemAlloc_v2)."""
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise RuntimeError(f"CUDA driver call {name} failed with error {status}")

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self.call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        return ptr.value

    def zero(self, ptr: int, nbytes: int):
        self.call("cuMemsetD8_v2", ctypes.c_uint64(ptr), ctypes.c_ubyte(0), ctypes.c_size_t(nbytes))
        torch.cuda.synchronize()

    def ipc_handle(self, ptr: int) -> bytes:
        handle = _IpcHandle()
        self.call("cuIpcGetMemHandle", ctypes.byref(handle), ctypes.c_uint64(ptr))
        return bytes(handle.bytes)

    def ipc_open(self, handle: bytes) -> int:
        ptr = ctypes.c_uint64()
        self.call("cuIpcOpenMemHandle_v2", ctypes.byref(ptr), _IpcHandle.from_buffer_copy(handle),
                  ctypes.c_uint(self.LAZY_ENABLE_PEER_ACCESS))
        return ptr.value

    def release(self, own: int | None, opened: list[int]):
        """Unmap the peers' buffers and free this rank's; errors ignored (at the process's end the
        context may be gone already)."""
        for ptr in opened:
            try:
                self.call("cuIpcCloseMemHandle", ctypes.c_uint64(ptr))
            except RuntimeError:
                pass
        try:
            if own is not None:
                self.call("cuMemFree_v2", ctypes.c_uint64(own))
        except RuntimeError:
            pass


def buffer_bytes(world: int, slot_bytes: int) -> int:
    """A rank's buffer: two halves of `world` slots, then world x MAX_PROGRAMS int64 flags."""
    return 2 * world * slot_bytes + world * MAX_PROGRAMS * 8

"""LoRAManager: owns the adapters of one engine — the name registry, the CPU cache and the device slots.

Three tiers, like vLLM:

* **registered** (``add``/``remove``; ``--lora-modules`` and ``/v1/load_lora_adapter``): name -> directory. Validated
  once when registered, so a broken adapter is refused up front (``LoRAError`` -> 400).
* **CPU cache** (``max_cpu_loras``): loaded float32 weights, LRU. An evicted adapter is re-read from its directory on
  its next request (and gets the digest of what is there now).
* **device slots** (``max_loras``): the stacked A/B tensors inside the model's :class:`LoRALinear` wrappers. ``activate``
  gives every adapter of a step a slot, evicting least-recently-used slots whose adapter has no unfinished request first;
  an adapter of the step itself is never evicted. The scheduler admits at most ``max_loras`` distinct adapters among
  running requests, so a step always fits.

Requests hold the :class:`LoRAAdapter` object they were admitted with (``acquire``/``release``): unloading or
re-registering a name never changes the weights under a running request.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import Counter, OrderedDict
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from pdserve.kernels.lora import LoRABatch, LoRAContext, LoRALinear
from pdserve.runtime.config import LoRAConfig
from pdserve.runtime.lora_adapter import TARGETS, LoRAAdapter, LoRAError, ProjShapes, load_adapter

log = logging.getLogger(__name__)

# our module -> PEFT projections of its shards, in shard order
_MODULES: dict[str, list[str]] = {}
for _proj, (_mod, _idx) in TARGETS.items():
    _MODULES.setdefault(_mod, []).insert(_idx, _proj)


class LoRANotFound(KeyError):
    """No adapter of that name is registered (the server answers 404)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "LoRA adapter not found"


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.max_cpu_loras = max(config.max_cpu_loras or config.max_loras, config.max_loras)
        self.shapes = ProjShapes.from_model(model)
        self.ctx = LoRAContext()
        self.registry: dict[str, tuple[str, str | None]] = {}        # name -> (path, base_model_name)
        self._digests: dict[str, str] = {}                           # name -> digest of its last load
        self.cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()      # name -> loaded, least recently used first
        self.slots: list[LoRAAdapter | None] = [None] * config.max_loras
        self._slot_lru: OrderedDict[int, int] = OrderedDict()        # int_id -> slot, least recently used first
        self._ids = itertools.count(1)
        # int_id -> adapter while anything holds it (requests do): how the runner, which sees only ids, finds weights
        self._by_id: weakref.WeakValueDictionary[int, LoRAAdapter] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()  # registry edits may come from the server thread while the engine steps
        self.requests_total: Counter[str] = Counter()                # per adapter name
        self.num_slot_loads = 0
        self.num_mixed_steps = 0          # steps whose batch held >= 2 adapters (and the test's proof of batching)
        self.last_step_slots: list[int] = []  # slot of every scheduled sequence in the last step (-1 = base)
        self.wrappers: list[dict[str, LoRALinear]] = []
        for layer in model.layers:
            wrapped = {}
            for mod, projs in _MODULES.items():
                parent_name, _, child = mod.rpartition(".")
                parent = layer.get_submodule(parent_name)
                fan_in = self.shapes.shapes[projs[0]][0]
                outs = [self.shapes.shapes[p][1] for p in projs]
                w = LoRALinear(getattr(parent, child), self.ctx, fan_in, outs, config.max_loras, config.max_lora_rank,
                               device, dtype)
                setattr(parent, child, w)
                wrapped[mod] = w
            self.wrappers.append(wrapped)

    # ---- registry (any thread) ---------------------------------------------------------------------------------------
    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRAAdapter:
        """Register and load ``name`` from ``path``. LoRAError (with the reason) if it is invalid or the name is taken."""
        if not name or not isinstance(name, str):
            raise LoRAError("lora_name must be a non-empty string")
        with self._lock:
            if name in self.registry:
                raise LoRAError(f"The lora adapter '{name}' has already been loaded.")
        adapter = self._load(name, path)  # outside the lock: reading the files may take a while
        adapter.base_model_name = base_model_name
        with self._lock:
            if name in self.registry:
                raise LoRAError(f"The lora adapter '{name}' has already been loaded.")
            self.registry[name] = (str(path), base_model_name)
            self._digests[name] = adapter.digest
            self._cache(adapter)
        log.info("LoRA adapter %r loaded from %s (rank %d, digest %s)", name, path, adapter.rank, adapter.digest[:12])
        return adapter

    def remove(self, name: str) -> None:
        """Unregister ``name``; running requests finish with the weights they started with."""
        with self._lock:
            if self.registry.pop(name, None) is None:
                raise LoRANotFound(f"The lora adapter '{name}' cannot be found.")
            self.cpu.pop(name, None)
            self._digests.pop(name, None)

    def names(self) -> list[tuple[str, str, str | None]]:
        """(name, path, base_model_name) of every registered adapter."""
        with self._lock:
            return [(n, path, base) for n, (path, base) in self.registry.items()]

    def digests(self) -> dict[str, str]:
        """name -> weight digest of every registered adapter, as of its last load (the prefix-cache identity; the
        router keys its block hashes with it, see router/plugins/precise_prefix.py)."""
        with self._lock:
            return {n: self._digests[n] for n in self.registry if n in self._digests}

    def __contains__(self, name: str) -> bool:
        return name in self.registry

    # ---- requests (engine thread) ---------------------------------------------------------------------------------------
    def acquire(self, name: str) -> LoRAAdapter:
        """The adapter a new request runs with (loaded into the CPU cache if evicted); pinned until ``release``."""
        with self._lock:
            if name not in self.registry:
                raise LoRANotFound(f"The model `{name}` does not exist.")
            path, base = self.registry[name]
            adapter = self.cpu.get(name)
            if adapter is not None:
                self.cpu.move_to_end(name)
        if adapter is None:
            adapter = self._load(name, path)
            adapter.base_model_name = base
            with self._lock:
                if self.registry.get(name, (None,))[0] == path:
                    adapter = self.cpu.get(name, adapter)
                    self._digests[name] = adapter.digest
                    self._cache(adapter)
        adapter.ref_count += 1
        with self._lock:
            self.requests_total[name] += 1
        return adapter

    def request_counts(self) -> dict[str, int]:
        """Requests admitted per adapter name so far (any thread)."""
        with self._lock:
            return dict(self.requests_total)

    def release(self, adapter: LoRAAdapter) -> None:
        adapter.ref_count = max(0, adapter.ref_count - 1)
        with self._lock:
            self._evict_cpu()

    # ---- steps (engine thread) ------------------------------------------------------------------------------------------
    def step_context(self, lora_ids: list[int], num_tokens: list[int],
                     device: torch.device) -> AbstractContextManager:
        """Give the step's adapters slots and return the context to run the forward pass in. ``lora_ids[i]`` is the
        adapter id (``LoRAAdapter.int_id``, 0: the base model) of scheduled row i, ``num_tokens[i]`` its token count
        this step."""
        adapters = [self._by_id[i] if i else None for i in lora_ids]
        slot_of = self.activate([a for a in adapters if a is not None])
        seq_slots = [-1 if a is None else slot_of[a.int_id] for a in adapters]
        self.last_step_slots = seq_slots
        if len({s for s in seq_slots if s >= 0}) >= 2:
            self.num_mixed_steps += 1
        token_slots = torch.repeat_interleave(torch.tensor(seq_slots, dtype=torch.int64),
                                              torch.tensor(num_tokens, dtype=torch.int64))
        ranks = {slot_of[a.int_id]: a.rank for a in adapters if a is not None}
        batch = LoRABatch.build(token_slots, ranks, device)
        return nullcontext() if batch is None else self.ctx.use(batch)

    def activate(self, adapters: list[LoRAAdapter]) -> dict[int, int]:
        """int_id -> slot for every adapter (loading the missing ones into evicted slots)."""
        wanted = {a.int_id: a for a in adapters}
        if len(wanted) > len(self.slots):
            raise RuntimeError(f"{len(wanted)} adapters in one step, only {len(self.slots)} LoRA slots (--max-loras)")
        out = {}
        for int_id, adapter in wanted.items():
            slot = self._slot_lru.get(int_id)
            if slot is None:
                slot = self._free_slot(wanted)
                self._write_slot(slot, adapter)
            self._slot_lru[int_id] = slot
            self._slot_lru.move_to_end(int_id)
            out[int_id] = slot
        return out

    def resident(self) -> list[str]:
        """Names of the adapters in device slots."""
        return [a.name for a in self.slots if a is not None]

    # ---- internals -----------------------------------------------------------------------------------------------------
    def _load(self, name: str, path: str) -> LoRAAdapter:
        adapter = load_adapter(name, path, self.shapes, self.config.max_lora_rank)
        adapter.int_id = next(self._ids)
        self._by_id[adapter.int_id] = adapter
        return adapter

    def _cache(self, adapter: LoRAAdapter) -> None:
        self.cpu[adapter.name] = adapter
        self.cpu.move_to_end(adapter.name)
        self._evict_cpu()

    def _evict_cpu(self) -> None:
        for name in list(self.cpu):
            if len(self.cpu) <= self.max_cpu_loras:
                break
            if self.cpu[name].ref_count == 0:  # an adapter in use stays (the cache may then exceed its size)
                del self.cpu[name]

    def _free_slot(self, wanted: dict[int, LoRAAdapter]) -> int:
        for slot, a in enumerate(self.slots):
            if a is None:
                return slot
        # Prefer adapters no unfinished request uses, then any not in this step; least recently used first.
        candidates = [(i, s) for i, s in self._slot_lru.items() if i not in wanted]
        idle = [c for c in candidates if self.slots[c[1]].ref_count == 0]
        int_id, slot = (idle or candidates)[0]
        del self._slot_lru[int_id]
        return slot

    @torch.no_grad()
    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer, wrapped in enumerate(self.wrappers):
            for mod, projs in _MODULES.items():
                for shard, proj in enumerate(projs):
                    w = adapter.weights.get((layer, proj))
                    wrapped[mod].set_slot(slot, shard, None if w is None else w.a, None if w is None else w.b,
                                          0.0 if w is None else w.scaling)
        self.slots[slot] = adapter
        self.num_slot_loads += 1

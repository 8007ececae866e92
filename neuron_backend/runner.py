"""Runners: one bucket call of a built model, whatever holds it, behind one signature the engine drives.

    runner(input_ids [B, T], start_pos [B], n_valid [B], sampling) -> next tokens [B] int64 (CPU)

`sampling` is None (greedy-only buckets, settings.sample_cap = 0) or the [B] tensors of sampling.SAMPLING_INPUTS.
The KV cache lives inside the runner (module buffers, rank processes, NeuronCores); only token ids, positions,
sampling settings and the host-side PLE rows cross per call. Each runner has `cfg`, `settings` and `close()`.

    ModuleRunner     an in-process NeuronGemma4ForCausalLM (TP=1, or any module with its collectives)
    GlooTPRunner     settings.tp CPU processes over gloo, one per rank, each holding its shard: the host (the
                     engine thread) sends every call to all ranks, as the Neuron runtime feeds every core, and
                     checks that the ranks agree on the tokens (they must: one distributed argmax / one draw)
    CompiledRunner   compile.CompiledModel on NeuronCores (needs the Neuron SDK; never run here)
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.multiprocessing as mp

from .config import BuildSettings, TextConfig

CALL_TIMEOUT_S = 600.0  # one call of a rank process (a gloo rank that died leaves the other waiting)


def _tokens(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


class ModuleRunner:
    def __init__(self, model, ple=None):
        self.model, self.ple = model, ple
        self.cfg: TextConfig = model.cfg
        self.settings: BuildSettings = model.settings

    @torch.no_grad()
    def __call__(self, ids, start, valid, sampling=None):
        ple = self.ple(ids) if self.ple is not None else None
        return _tokens(self.model(ids, start, valid, ple, *(sampling or ())))

    def close(self) -> None:
        pass


class CompiledRunner:
    """compile.CompiledModel: the artifact's buckets on the NeuronCores (untested: no Neuron hardware here)."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.cfg, self.settings = compiled.cfg, compiled.settings

    @torch.no_grad()
    def __call__(self, ids, start, valid, sampling=None):
        ple = self.compiled.ple(ids) if self.compiled.ple is not None else None
        return _tokens(self.compiled.step(ids, start, valid, ple, *(sampling or ()))).cpu()

    def close(self) -> None:
        pass


def _rank_main(rank, world, port, hf_sd, cfg, settings, conn, setup):
    """A rank process: build this rank's module, then run every call the host sends until it sends None."""
    import torch.distributed as dist

    from .collectives import GlooCollectives
    from .loader import build_rank_model

    torch.set_num_threads(1)  # ranks share the machine's cores
    try:
        if setup is not None:
            setup()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        model, ple, _ = build_rank_model(hf_sd, cfg, settings, rank=rank, comm=GlooCollectives())
        del hf_sd
        run = ModuleRunner(model, ple)
        conn.send(("ready", None))
    except BaseException as e:  # noqa: BLE001 - report, do not hang the host
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            ids, start, valid, sampling = msg
            try:
                sampling = None if sampling is None else tuple(torch.from_numpy(x) for x in sampling)
                out = run(torch.from_numpy(ids), torch.from_numpy(start), torch.from_numpy(valid), sampling)
                conn.send(("ok", out.numpy()))
            except Exception as e:  # noqa: BLE001 - the host fails the call; the ranks stay up
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


class GlooTPRunner:
    """settings.tp rank processes over gloo (spawned), each building its shard from the HF state dict `hf_sd`.

    `setup` (a picklable module-level function) runs first in every rank process (a test's way in)."""

    def __init__(self, hf_sd, cfg: TextConfig, settings: BuildSettings, setup=None, start_timeout_s: float = 300.0):
        from .cpu_tp import free_port

        self.cfg, self.settings = cfg, settings
        ctx = mp.get_context("spawn")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        port = free_port()
        hf_sd = {k: v.detach().contiguous() for k, v in hf_sd.items()}
        self._conns, self._procs = [], []
        for rank in range(settings.tp):
            host_end, rank_end = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, settings.tp, port, hf_sd, cfg, settings, rank_end, setup),
                               daemon=True, name=f"neuron-backend-tp{rank}")  # fmt: skip
            proc.start()
            rank_end.close()
            self._conns.append(host_end)
            self._procs.append(proc)
        try:
            for rank, status in enumerate(self._receive(start_timeout_s)):
                if status[0] != "ready":
                    raise RuntimeError(f"TP rank {rank} failed to start: {status[1]}")
        except BaseException:
            self.close()
            raise

    def _receive(self, timeout: float) -> list:
        out = []
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs)):
            if not conn.poll(timeout):
                raise RuntimeError(f"TP rank {rank} did not answer within {timeout:.0f} s (alive: {proc.is_alive()})")
            try:
                out.append(conn.recv())
            except EOFError:
                raise RuntimeError(f"TP rank {rank} exited (exit code {proc.exitcode})") from None
        return out

    def __call__(self, ids, start, valid, sampling=None):
        msg = (ids.numpy(), start.numpy(), valid.numpy(),
               None if sampling is None else tuple(x.numpy() for x in sampling))  # fmt: skip
        for conn in self._conns:
            conn.send(msg)
        answers = self._receive(CALL_TIMEOUT_S)
        errors = [f"rank {r}: {a[1]}" for r, a in enumerate(answers) if a[0] != "ok"]
        if errors:
            raise RuntimeError("TP call failed: " + "; ".join(errors))
        tokens = [a[1] for a in answers]
        if any(not np.array_equal(t, tokens[0]) for t in tokens[1:]):
            raise RuntimeError(f"TP ranks disagree on the next tokens: {[t.tolist() for t in tokens]}")
        return torch.from_numpy(tokens[0])

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

"""What one rank of a sharded load holds in host memory: a random Llama of 1.77 GB (fp32, 24 layers, hidden 1,024)
loaded whole by transformers, then by target.sharded.load_sharded over 2 and 4 gloo ranks on the CPU, and by one
rank streaming its own copy (--offload cpu on one device: targets/streamed.py, its "device" the CPU here); every
parameter is read once after the load, and each process prints its resident anonymous and file-backed memory.

    python3 bench/shard_memory.py --work /tmp/sm          # builds the target, runs all four, prints the lines

On the CPU the shards stay views of the safetensors' page cache (file-backed): a rank's file-backed memory is the
part of the weights it reads. The streamed rank copies each layer into a buffer of its own (anonymous memory, which
on a GPU is page-locked), so its weights are counted there, beside the two slots a layer runs from.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch


def _rss() -> str:
    d = {k: int(v.split()[0]) / 1e6 for k, v in (line.split(":", 1) for line in open("/proc/self/status"))
         if k in ("VmHWM", "RssAnon", "RssFile")}
    return f"anon {d['RssAnon']:.2f} GB + file-backed {d['RssFile']:.2f} GB (peak {d['VmHWM']:.2f} GB)"


@torch.no_grad()
def _touch(model) -> None:
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        float(t.float().sum())


def child(folder: str, mode: str) -> None:
    from dflash.targets import sharded

    base = _rss()
    if mode == "whole":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        _touch(model)
        print(f"whole: {_rss()} (after the imports: {base})", flush=True)
        return
    import torch.distributed as dist

    sharded.init_group(torch.device("cpu"), 120)
    if mode == "streamed":
        model = sharded.load_sharded(folder, torch.device("cpu"), "float32", 1, True)
        _touch(model)
        stream = model.dflash_stream
        with torch.no_grad():  # one forward through the slots
            model(input_ids=torch.zeros((1, 16), dtype=torch.long), use_cache=False)
        print(f"streamed, one rank: holds {stream.host_bytes / 1e9:.2f} GB of layers in its buffers and "
              f"{sum(x.numel() for x in stream.slots) / 1e9:.2f} GB of slots; {_rss()} (after the imports: {base})",
              flush=True)
        sharded.release_group()
        return
    model = sharded.load_sharded(folder, torch.device("cpu"), "float32", dist.get_world_size(), False)
    _touch(model)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}: holds {sharded.bytes_of(model) / 1e9:.2f} GB of "
          f"weights; {_rss()} (after the imports: {base})", flush=True)
    sharded.release_group()


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("bench-shard-memory"))
    args = ap.parse_args()
    folder = args.work / "llama-1.8gb"
    if not (folder / "model.safetensors").is_file():
        import transformers as tf

        cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                             num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False)
        tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    me = str(Path(__file__).resolve())
    subprocess.run([sys.executable, me, "--child", str(folder), "whole"], env=env, check=True)
    subprocess.run([sys.executable, me, "--child", str(folder), "streamed"], env=env, check=True)
    for n in (2, 4):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                        me, "--child", str(folder), "sharded"], env=env, check=True, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()

"""A SmolLM2-135M-shaped model with random bf16 weights (the real config and tokenizer), for
timings only: `python3 random_model.py CONFIG_DIR OUT_DIR` (tools/gpu/run.sh)."""
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(src)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(dst)
for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(src / name, dst / name)
print("model written:", sorted(p.name for p in dst.iterdir()))

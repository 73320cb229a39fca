"""An in-process llama_cpp.Llama whose layers live on two arcsplit-run rpc-servers (needs arcsplit[inproc]).

    python examples/inproc_load.py [MODEL.gguf]
"""

import sys

import arcsplit
from arcsplit.demo import ensure_demo_model

model = sys.argv[1] if len(sys.argv) > 1 else str(ensure_demo_model())
llm = arcsplit.load(model, gpus=[0, 1], backend="cpu", cpu_memory_mib=1024, ctx=2048, threads=1)
print("split", llm.arcsplit_plan.tensor_split, "on", llm.arcsplit_endpoints)
out = llm.create_completion("The capital of France is", max_tokens=8, temperature=0.0, top_k=1)
print("answer:", out["choices"][0]["text"].strip())
llm.close()

"""hvd_sgd's three MNIST models, layer for layer in PyTorch, one training step on this GPU:
eager (launched op by op from Python) and replayed as one CUDA graph.

How the H200 steps of benchmarks/notes/2026-12-04-h200.md were measured, on a machine with PyTorch and CUDA but no
TensorFlow that Horovod 0.28.1 builds against: ``python3 run/gpu_step_pytorch.py`` writes
gpu_step.json to $OUT (or here). Not part of the package: nothing imports it."""
import json
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.backends.cudnn.benchmark = True
torch.backends.cuda.matmul.allow_tf32 = False  # fp32, as the CPU runs
torch.backends.cudnn.allow_tf32 = False


class Softmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.logits = nn.Linear(784, 10)
    def forward(self, x):
        return self.logits(x.flatten(1))


class Cnn(nn.Module):  # models.cnn: rescale, conv16+pool, conv32+pool, conv64, dense 64, logits
    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(1, 16, 3, padding=1), nn.Conv2d(16, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1)
        self.d, self.logits = nn.Linear(64 * 7 * 7, 64), nn.Linear(64, 10)
    def forward(self, x):
        x = x * 2 - 1
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        x = F.relu(self.c3(x))
        return self.logits(F.relu(self.d(x.flatten(1))))


class ClassicCnn(nn.Module):  # models.classic_cnn
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 32, 3), nn.Conv2d(32, 64, 3)
        self.d, self.logits = nn.Linear(64 * 12 * 12, 128), nn.Linear(128, 10)
    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c2(F.relu(self.c1(x)))), 2)
        x = F.dropout(x, 0.25, self.training)
        x = F.dropout(F.relu(self.d(x.flatten(1))), 0.5, self.training)
        return self.logits(x)


MODELS = {"softmax": Softmax, "cnn": Cnn, "classic_cnn": ClassicCnn}


def measure(name, batch, graphed, blocks=7, per_block=200):
    model = MODELS[name]().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.rand(batch, 1, 28, 28, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")

    def step():
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    s = torch.cuda.Stream()  # warm-up on a side stream, as CUDA graph capture requires
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(5):
            step()
    torch.cuda.current_stream().wait_stream(s)
    run = step
    if graphed:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        run = g.replay
    for _ in range(20):
        run()
    torch.cuda.synchronize()
    seconds = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(per_block):
            run()
        torch.cuda.synchronize()
        seconds.append((time.perf_counter() - t) / per_block)
    return statistics.median(seconds), min(seconds), max(seconds)


def main():
    out = os.environ.get("OUT", ".")
    info = dict(torch=torch.__version__, device=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version())
    print(info, flush=True)
    rows = []
    for name in MODELS:
        for batch in (32, 64, 100, 256, 1024, 4096):
            for graphed in (False, True):
                med, lo, hi = measure(name, batch, graphed)
                row = dict(model=name, batch=batch, mode="cuda_graph" if graphed else "eager",
                           step_ms=med * 1e3, min_ms=lo * 1e3, max_ms=hi * 1e3, img_per_s=batch / med)
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(os.path.join(out, "gpu_step.json"), "w") as f:
        json.dump(dict(info=info, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

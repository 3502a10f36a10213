"""Hardware a plan is made for: roofline figures, memory and links of vendors' devices, this machine, or a file.

A plan costs every operator as ``max(flops / rate, bytes / bandwidth) + overhead`` seconds
(:func:`~ppll_compile.cost.roofline.seconds`). On this machine the rates are calibrated (:func:`ppll_compile.calibrate`);
for the devices a model is trained on they come from the vendor's public specification: the dense (not sparsity)
peak of each operator family's units, times the fraction of that peak a training step achieves (written down
below, with the reason for it), and the memory bandwidth times an achievable fraction for the memory-bound
families. ``plan(..., hardware="h100")`` prices a plan with them and times nothing here; the device's memory
becomes the default ``memory_limit`` and its intra-node link the default ``link_bandwidth``.

Which units run float32 under PyTorch's defaults: matrix products and attention on NVIDIA parts run on the FP32
CUDA cores (``torch.backends.cuda.matmul.allow_tf32`` is off by default), convolutions on the TF32 tensor cores
(``torch.backends.cudnn.allow_tf32`` is on by default); the MI300X runs float32 on its FP32 matrix cores.
bfloat16 and float16 run on the tensor (matrix) cores.

Memory sizes are the datasheet's "GB" read as 10^9 bytes: a little less than the device shows (an "80 GB" H100
shows about 79 GiB = 85e9 bytes), which leaves the CUDA context and the allocator's slack a few GiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import PlanError
from .figures import PRESET_SOURCE, DeviceFigures, read_figures
from .oplog import COMPUTE
from .roofline import device_memory

COMPUTE_FRACTION = {"matmul": 0.7, "attention": 0.5, "conv": 0.5, "conv_bwd": 0.4}
"""Assumed fraction of the dense peak each compute family achieves. ``matmul`` 0.7: cuBLAS/hipBLASLt GEMMs of
training shapes reach 70-80% of the dense peak (NVIDIA, "Matrix Multiplication Background User's Guide", the
tensor-core utilisation it shows for large tiles); smaller and skinnier products reach less. ``attention`` 0.5:
FlashAttention-2 (Dao, 2023, its Figures 4-7) reaches 50-73% of the A100's peak forward and less backward.
``conv`` 0.5 and ``conv_bwd`` 0.4: cuDNN convolutions of CNN training run below GEMMs of the same FLOPs (im2col
and layout transforms), and their weight gradients below their forward."""
MEMORY_FRACTION = {"memory": 0.8, "step": 0.8, "math": 0.7, "norm": 0.5, "pool": 0.5}
"""Assumed fraction of the peak memory bandwidth each memory-bound family achieves. ``memory`` and ``step``
0.8: streaming element-wise kernels (and fused optimizer steps) reach 80-90% of HBM peak (STREAM-like copies
on A100/H100); ``math`` 0.7: transcendental activations and softmax add arithmetic per byte; ``norm`` and
``pool`` 0.5: they read their input more than once and reduce across it, which the counted bytes do not show."""
LINK_FRACTION = 0.8
"""Assumed fraction of a link's peak (one direction) that a point-to-point transfer of activations achieves
(NCCL's p2p and bus bandwidth over NVLink, PCIe and InfiniBand reach 80-95% of the link's rate for messages of
megabytes)."""
OVERHEAD = 5e-6
"""Assumed seconds every operator costs beyond its work on a GPU: PyTorch's eager dispatch plus a kernel launch
(a few microseconds each; not a datasheet figure)."""

_NVLINK4 = 450e9  # NVLink 4 (H100/H200 SXM): 900 GB/s total per GPU = 450 GB/s each way, to any GPU via NVSwitch
_NVLINK3 = 300e9  # NVLink 3 (A100 SXM): 600 GB/s total per GPU = 300 GB/s each way, via NVSwitch (DGX/HGX A100)
_PCIE4 = 32e9  # PCIe Gen4 x16: 64 GB/s bidirectional (L40S datasheet) = 32 GB/s each way
_NDR = 50e9  # InfiniBand NDR 400 Gb/s, one ConnectX-7 per GPU (DGX H100/H200, HGX MI300X platforms) = 50 GB/s
_HDR = 25e9  # InfiniBand HDR 200 Gb/s, one ConnectX-6 per GPU (DGX A100) = 25 GB/s each way


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One kind of device a plan is made for: its roofline figures, memory, links and where they come from."""

    name: str
    """The preset's name (``h100``, ...), or the figures file's path."""
    figures: DeviceFigures | None
    """What the device does per second (rates by ``family:dtype``, per-operator overhead); ``None`` for ``cpu``:
    this machine's, calibrated and timed per operator shape when a plan needs them (the default path)."""
    memory_bytes: int | None
    """Bytes of memory per device: the default ``memory_limit`` (``None``: no default cap)."""
    intra_node_bandwidth: float | None
    """Bytes per second, one direction, between two devices of a node (``None``: unknown, ``link_bandwidth``
    stands)."""
    inter_node_bandwidth: float | None
    """Bytes per second, one direction, from a device to one in another node (``None``: unknown)."""
    gpus_per_node: int | None
    """Devices per node (``None``: one node holds them all)."""
    sources: str
    """Where the figures come from: the documents, their tables, and the fractions assumed."""

    @property
    def local(self) -> bool:
        """Whether the figures are this machine's, calibrated here (the ``cpu`` preset)."""
        return self.figures is None


def _gpu(name: str, device: str, *, fp32: float, fp32_conv: float, half: float, bandwidth: float, memory_gb: float,
         intra: float, inter: float, per_node: int, document: str, notes: str) -> Hardware:
    """A GPU preset from its datasheet peaks (FLOP/s, dense): ``fp32`` the units float32 matrix products and
    attention run on, ``fp32_conv`` those float32 convolutions run on, ``half`` the bfloat16/float16 tensor cores;
    ``bandwidth`` bytes/s of memory; ``intra`` and ``inter`` the link peaks each way."""
    rates: dict[str, float] = {}
    for family in COMPUTE:
        peak32 = fp32_conv if family.startswith("conv") else fp32
        rates[f"{family}:float32"] = peak32 * COMPUTE_FRACTION[family]
        for dtype in ("bfloat16", "float16"):
            rates[f"{family}:{dtype}"] = half * COMPUTE_FRACTION[family]
    for family, fraction in MEMORY_FRACTION.items():
        rates[f"{family}:float32"] = bandwidth * fraction
    figures = DeviceFigures(device=device, torch="any", rates=rates, overhead=OVERHEAD,
                            source=f"{PRESET_SOURCE}{name} ({document})", memory_bytes=int(memory_gb * 1e9))
    return Hardware(name=name, figures=figures, memory_bytes=figures.memory_bytes,
                    intra_node_bandwidth=intra * LINK_FRACTION, inter_node_bandwidth=inter * LINK_FRACTION,
                    gpus_per_node=per_node, sources=f"{document}; {notes}")


_DENSE = "dense tensor-core figures (the datasheet's starred ones are with sparsity, halved here)"
PRESETS: dict[str, Hardware] = {h.name: h for h in (
    # NVIDIA H100 Tensor Core GPU datasheet, "Technical Specifications", H100 SXM column: FP32 67 TFLOPS,
    # TF32 Tensor Core 989 TFLOPS* (494.5 dense), BF16/FP16 Tensor Core 1,979 TFLOPS* (989.5 dense), GPU memory
    # 80 GB, memory bandwidth 3.35 TB/s, NVIDIA NVLink 900 GB/s; DGX H100: 8 GPUs, one 400 Gb/s ConnectX-7 each.
    _gpu("h100", "NVIDIA H100 SXM 80GB", fp32=67e12, fp32_conv=494.5e12, half=989.5e12, bandwidth=3.35e12,
         memory_gb=80, intra=_NVLINK4, inter=_NDR, per_node=8,
         document="NVIDIA H100 Tensor Core GPU datasheet, Technical Specifications, H100 SXM column",
         notes=f"{_DENSE}; NVLink 4 450 GB/s each way; InfiniBand NDR 400 Gb/s per GPU (DGX H100)"),
    # NVIDIA H200 Tensor Core GPU datasheet, "Technical Specifications", H200 SXM column: FP32 67 TFLOPS, TF32
    # 989 TFLOPS*, BF16/FP16 1,979 TFLOPS* (same dies as H100), GPU memory 141 GB, memory bandwidth 4.8 TB/s,
    # NVLink 900 GB/s; DGX H200: 8 GPUs, one 400 Gb/s ConnectX-7 each.
    _gpu("h200", "NVIDIA H200 SXM 141GB", fp32=67e12, fp32_conv=494.5e12, half=989.5e12, bandwidth=4.8e12,
         memory_gb=141, intra=_NVLINK4, inter=_NDR, per_node=8,
         document="NVIDIA H200 Tensor Core GPU datasheet, Technical Specifications, H200 SXM column",
         notes=f"{_DENSE}; NVLink 4 450 GB/s each way; InfiniBand NDR 400 Gb/s per GPU (DGX H200)"),
    # NVIDIA A100 Tensor Core GPU datasheet, "Specifications", A100 80GB SXM column: FP32 19.5 TFLOPS, TF32 Tensor
    # Core 156 TFLOPS (312*), BF16/FP16 Tensor Core 312 TFLOPS (624*), GPU memory 80 GB HBM2e, bandwidth
    # 2,039 GB/s, NVLink 600 GB/s; DGX A100: 8 GPUs, one 200 Gb/s HDR ConnectX-6 each.
    _gpu("a100-80gb", "NVIDIA A100 SXM 80GB", fp32=19.5e12, fp32_conv=156e12, half=312e12, bandwidth=2.039e12,
         memory_gb=80, intra=_NVLINK3, inter=_HDR, per_node=8,
         document="NVIDIA A100 Tensor Core GPU datasheet, Specifications, A100 80GB SXM column",
         notes=f"{_DENSE}; NVLink 3 300 GB/s each way; InfiniBand HDR 200 Gb/s per GPU (DGX A100)"),
    # The same datasheet, A100 40GB SXM column (as first published): the same compute, GPU memory 40 GB HBM2,
    # bandwidth 1,555 GB/s, NVLink 600 GB/s.
    _gpu("a100-40gb", "NVIDIA A100 SXM 40GB", fp32=19.5e12, fp32_conv=156e12, half=312e12, bandwidth=1.555e12,
         memory_gb=40, intra=_NVLINK3, inter=_HDR, per_node=8,
         document="NVIDIA A100 Tensor Core GPU datasheet, Specifications, A100 40GB SXM column",
         notes=f"{_DENSE}; NVLink 3 300 GB/s each way; InfiniBand HDR 200 Gb/s per GPU (DGX A100)"),
    # NVIDIA L40S datasheet, "Specifications": FP32 91.6 TFLOPS, TF32 Tensor Core 183 TFLOPS (366*), BF16/FP16
    # Tensor Core 362.05 TFLOPS (733*), GPU memory 48 GB GDDR6 with ECC, bandwidth 864 GB/s, interconnect PCIe
    # Gen4 x16 64 GB/s bidirectional (no NVLink). Across nodes: assumed one 400 Gb/s NIC per two GPUs (25 GB/s
    # per GPU); L40S servers have no standard fabric.
    _gpu("l40s", "NVIDIA L40S 48GB", fp32=91.6e12, fp32_conv=183e12, half=362.05e12, bandwidth=864e9, memory_gb=48,
         intra=_PCIE4, inter=_HDR, per_node=8,
         document="NVIDIA L40S GPU datasheet, Specifications",
         notes=f"{_DENSE}; PCIe Gen4 x16 32 GB/s each way; across nodes assumed 25 GB/s per GPU (one 400 Gb/s "
               f"NIC per two GPUs: servers vary)"),
    # AMD Instinct MI300X accelerator datasheet: peak FP32 (vector and matrix) 163.4 TFLOPS, BF16/FP16 1,307.4
    # TFLOPS dense (2,614.9 with sparsity), 192 GB HBM3, peak memory bandwidth 5.3 TB/s, 7 AMD Infinity Fabric
    # links of 128 GB/s peak (bidirectional) each: on an 8-GPU platform one direct link joins two GPUs, 64 GB/s
    # each way (448 GB/s each way to all seven, for collectives). Across nodes: one 400 Gb/s NIC per GPU.
    _gpu("mi300x", "AMD Instinct MI300X 192GB", fp32=163.4e12, fp32_conv=163.4e12, half=1307.4e12,
         bandwidth=5.3e12, memory_gb=192, intra=64e9, inter=_NDR, per_node=8,
         document="AMD Instinct MI300X accelerator datasheet",
         notes="dense matrix-core figures (sparsity doubles them); Infinity Fabric 64 GB/s each way between two "
               "GPUs (one of 7 links of 128 GB/s bidirectional); 400 Gb/s per GPU across nodes"),
)}
"""The vendors' devices by name (``cpu``, this machine, is made when asked for)."""
NAMES = (*sorted(PRESETS), "cpu")
"""Every preset name ``hardware=`` takes (besides a figures file)."""
_LARGEST = max(PRESETS.values(), key=lambda h: h.memory_bytes or 0)
LARGEST_DEVICE_BYTES: int = _LARGEST.memory_bytes or 0
"""Memory of the largest device ppll-compile knows (its hardware presets): a head whose float32 parameters alone
exceed it fits no device."""
LARGEST_DEVICE: str = _LARGEST.name
"""The preset name of that device."""


def load_hardware(spec: str | Path) -> Hardware:
    """The hardware ``spec`` names: a preset of :data:`NAMES` (``cpu``: this machine, figures calibrated here), or
    the path of a JSON figures file as :func:`ppll_compile.calibrate` writes (``out=``), optionally with the
    device's ``memory_bytes`` and the link fields of :data:`~ppll_compile.cost.figures.FILE_EXTRAS`."""
    text = str(spec)
    if text in PRESETS:
        return PRESETS[text]
    if text == "cpu":
        return Hardware(name="cpu", figures=None, memory_bytes=device_memory(torch.device("cpu")),
                        intra_node_bandwidth=None, inter_node_bandwidth=None, gpus_per_node=None,
                        sources="this machine: figures calibrated here (ppll_compile.calibrate), memory from the OS")
    if not Path(text).exists():
        raise PlanError(f"unknown hardware {text!r}: not a preset and no such file; known presets: "
                        f"{', '.join(NAMES)}, or the path of a JSON figures file (ppll_compile.calibrate(out=...) "
                        f"writes one)")
    return _from_file(text)


def _from_file(path: str) -> Hardware:
    """The hardware a figures file describes, read and checked by :func:`~.figures.read_figures` (no further than
    :data:`~.figures.MAX_FIGURES_BYTES`, every field within :data:`~.figures.LIMITS`)."""
    figures, extras = read_figures(path, f"hardware={path}")
    links = {k: extras.get(k) for k in ("intra_node_bandwidth", "inter_node_bandwidth")}
    return Hardware(name=path, figures=figures, memory_bytes=figures.memory_bytes,
                    gpus_per_node=extras.get("gpus_per_node"),
                    sources=str(extras.get("sources") or f"the figures file {path}"),
                    **{k: float(v) if v is not None else None for k, v in links.items()})


def hardware_defaults(spec: str | Path | None, devices: int | None = None, nodes: bool = False) -> dict[str, Any]:
    """The plan options a hardware sets when the user gives none: ``memory_limit`` (its memory per device) and
    ``link_bandwidth`` (its intra-node link), where known; and, when ``devices`` are more than one of its nodes
    holds or the user gave ``gpus_per_node`` (``nodes``), its nodes with their intra- and inter-node links."""
    if spec is None:
        return {}
    hw = load_hardware(spec)
    defaults = {"memory_limit": hw.memory_bytes, "link_bandwidth": hw.intra_node_bandwidth}
    if hw.gpus_per_node is not None and (nodes or (devices is not None and devices > hw.gpus_per_node)):
        defaults.update(gpus_per_node=hw.gpus_per_node, intra_node_bandwidth=hw.intra_node_bandwidth,
                        inter_node_bandwidth=hw.inter_node_bandwidth)
    return {k: v for k, v in defaults.items() if v is not None}

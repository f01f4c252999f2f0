"""benchmarks/compute_split.py without a GPU: the kernels' classes by name, and the CLI's refusal."""

from __future__ import annotations

import pytest
import torch

from benchmarks import compute_split

# Kernel names as a Hopper GPU's profiler lists them (torch 2.11, CUDA 13; cuDNN's fused SDPA from an H200).
NAMES = {
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0": "attention",
    "void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*, void const*)": "attention",
    "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*)": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>()": "attention",
    "fmha_cutlassB_bf16_aligned_64x64_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel)": "attention",
    "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NNT": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>()": "gemm",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>()": "memory",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float>>>()": "memory",
    "_rms_norm_forward_kernel": "memory",
    "liger_cross_entropy_kernel": "memory",
    "Memcpy DtoD (Device -> Device)": "memory",
}


@pytest.mark.parametrize("name, cls", NAMES.items())
def test_kernels_are_classed_by_name(name: str, cls: str) -> None:
    assert compute_split.kernel_class(name) == cls


def test_the_measured_split_sums_microseconds_by_class() -> None:
    events = [(name, 1000.0) for name in NAMES]
    split = compute_split.measured_split(events)
    assert split == pytest.approx({"gemm": 3e-3, "attention": 5e-3, "memory": 5e-3})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_says_why_and_exits_2(capsys) -> None:
    assert compute_split.main(["--model", "llama3-8b", "--batch-size", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err

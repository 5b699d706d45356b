"""bench/compiled_sites.py's reading of Inductor's output code, on a `call` written by hand in
the form Inductor 2.x prints on the CPU: every count below is known from the text."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import compiled_sites  # noqa: E402

CODE = """
cpp_fused_add_mean_0 = async_compile.cpp_pybinding(['float*'], '''
extern "C" void kernel(float* out_ptr0) { }
''')

async_compile.wait(globals())
del async_compile

def call(args):
    arg0_1, arg1_1, arg2_1 = args
    args.clear()
    s72 = arg0_1
    buf0 = empty_strided_cpu((s72, 512), (512, 1), torch.float32)
    cpp_fused__to_copy_embedding_site_0(arg1_1, buf0, s72)
    torch.ops.xmix.site.default(buf0, None, 0)
    buf1 = empty_strided_cpu((s72, 512), (512, 1), torch.float32)
    cpp_fused_add_mean_mul_pow_rsqrt_1(buf0, buf1, s72)
    torch.ops._C.onednn_mm.default(buf3, buf1, None, arg2_1)
    buf4 = torch.ops.vllm.unified_kv_cache_update.default(buf3, arg2_1)
    torch.ops.vllm.unified_attention_with_output.default(buf3, buf4)
    torch.ops.xmix.site.default(buf3, buf0, 1)
    cpp_fused_add_mean_mul_pow_rsqrt_2(buf3, buf1, s72)
    buf5 = extern_kernels.mm(buf1, arg2_1)
    buf0.copy_(buf5)
    return (buf1, )


def benchmark_compiled_module(times=10, repeat=10):
    torch.ops.xmix.site.default(None, None, 9)
    cpp_fused_add_mean_mul_pow_rsqrt_1(None)
"""


def test_call_sequence_reads_the_first_call_only_in_order():
    assert compiled_sites.call_sequence(CODE) == [
        "kernel:cpp_fused__to_copy_embedding_site",
        "xmix.site",
        "kernel:cpp_fused_add_mean_mul_pow_rsqrt",
        "_C.onednn_mm",
        "vllm.unified_kv_cache_update",
        "vllm.unified_attention_with_output",
        "xmix.site",
        "kernel:cpp_fused_add_mean_mul_pow_rsqrt",
        "extern:mm",
        "copy",
    ]


def test_counts_and_kernel_difference():
    seq = compiled_sites.call_sequence(CODE)
    assert compiled_sites.counts(seq) == {
        "fused kernels": 3,
        "xmix.site calls": 2,
        "copies": 1,
        "other ops": 4,
        "calls in all": 10,
    }
    vanilla = ["kernel:cpp_fused_add_mean_mul_pow_rsqrt"] * 3 + ["_C.onednn_mm"]
    assert sorted(compiled_sites.kernel_diff(vanilla, seq)) == [
        "+cpp_fused__to_copy_embedding_site x1",
        "-cpp_fused_add_mean_mul_pow_rsqrt x1",
    ]
    table = compiled_sites.table({"a": compiled_sites.counts(seq)})
    assert table.splitlines()[2] == "| a | 3 | 2 | 1 | 4 | 10 |"

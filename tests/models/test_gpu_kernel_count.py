"""benchmarks/gpu_kernel_count.py's reading of optimized HLO, on a hand-written XLA:GPU module (no CUDA plugin, no
compile): which instructions launch kernels, which of them run inside the loop, and the GPU profile's class of each.

The module below is modelled on a compiled SD 1.5 loop (jaxlib 0.10.2, compile-only H100): a weight convert hoisted
out of a `while` loop; in the loop body a GroupNorm statistics fusion (kInput, two reduces), a command buffer
(`call`) holding a SiLU fusion and a cuDNN convolution, a second convolution, a tiled transpose (kInput, no reduce),
a concatenate of weights feeding a cuBLAS gemm (XLA's dot merger), a cuBLAS Lt matmul, cuDNN flash attention, a
skip-connection concatenate fusion, a layout copy and the step counter's add; the loop condition's compare.
"""

from __future__ import annotations

import bench_scripts
import pytest

BODY = "jit(loop)/while/body/closed_call/UNet2DConditionModel/down_blocks_0"

HLO = f"""\
HloModule jit_loop, is_scheduled=true, entry_computation_layout={{(bf16[2,64,64,320]{{3,2,1,0}}, bf16[960,320]{{1,0}})->bf16[2,64,64,320]{{3,2,1,0}}}}

%region_add (a.1: f32[], b.1: f32[]) -> f32[] {{
  %a.1 = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a.1, %b.1)
}}

%fused_convert (param_0: f32[960,320]) -> bf16[960,320] {{
  %param_0 = f32[960,320]{{1,0}} parameter(0)
  ROOT %convert.1 = bf16[960,320]{{1,0}} convert(%param_0), metadata={{op_name="jit(loop)/convert_element_type"}}
}}

%fused_reduce (param_0.1: bf16[2,4096,32,10]) -> (f32[2,32], f32[2,32]) {{
  %param_0.1 = bf16[2,4096,32,10]{{3,2,1,0}} parameter(0)
  %convert.2 = f32[2,4096,32,10]{{3,2,1,0}} convert(%param_0.1)
  %multiply.1 = f32[2,4096,32,10]{{3,2,1,0}} multiply(%convert.2, %convert.2)
  %constant.1 = f32[] constant(0)
  %reduce.1 = f32[2,32]{{1,0}} reduce(%convert.2, %constant.1), dimensions={{1,3}}, to_apply=%region_add, metadata={{op_name="{BODY}/resnets_0/norm1/reduce_sum"}}
  %reduce.2 = f32[2,32]{{1,0}} reduce(%multiply.1, %constant.1), dimensions={{1,3}}, to_apply=%region_add, metadata={{op_name="{BODY}/resnets_0/norm1/reduce_sum"}}
  ROOT %tuple.1 = (f32[2,32]{{1,0}}, f32[2,32]{{1,0}}) tuple(%reduce.1, %reduce.2)
}}

%fused_silu (param_0.2: bf16[2,64,64,320]) -> bf16[2,64,64,320] {{
  %param_0.2 = bf16[2,64,64,320]{{3,2,1,0}} parameter(0)
  %logistic.1 = bf16[2,64,64,320]{{3,2,1,0}} logistic(%param_0.2), metadata={{op_name="{BODY}/resnets_0/jit(silu)/logistic"}}
  ROOT %multiply.2 = bf16[2,64,64,320]{{3,2,1,0}} multiply(%param_0.2, %logistic.1), metadata={{op_name="{BODY}/resnets_0/jit(silu)/mul"}}
}}

%command_buffer (p.0: bf16[2,64,64,320], p.1: bf16[3,3,320,320]) -> bf16[2,64,64,320] {{
  %p.0 = bf16[2,64,64,320]{{3,2,1,0}} parameter(0)
  %p.1 = bf16[3,3,320,320]{{3,2,1,0}} parameter(1)
  %loop_multiply_fusion.1 = bf16[2,64,64,320]{{3,2,1,0}} fusion(%p.0), kind=kLoop, calls=%fused_silu, metadata={{op_name="{BODY}/resnets_0/jit(silu)/mul"}}
  %cudnn-conv.1 = (bf16[2,64,64,320]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%loop_multiply_fusion.1, %p.1), window={{size=3x3 pad=1_1x1_1}}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convForward", metadata={{op_name="{BODY}/resnets_0/conv1/conv_general_dilated"}}
  ROOT %get-tuple-element.1 = bf16[2,64,64,320]{{3,2,1,0}} get-tuple-element(%cudnn-conv.1), index=0
}}

%fused_transpose (param_0.3: bf16[2,4096,8,40]) -> bf16[2,8,4096,40] {{
  %param_0.3 = bf16[2,4096,8,40]{{3,2,1,0}} parameter(0)
  ROOT %transpose.1 = bf16[2,8,4096,40]{{3,2,1,0}} transpose(%param_0.3), dimensions={{0,2,1,3}}, metadata={{op_name="{BODY}/attentions_0/transformer_blocks_0/attn1/transpose"}}
}}

%fused_concatenate (param_0.4: bf16[2,64,64,320], param_1.4: bf16[2,64,64,320]) -> bf16[2,64,64,640] {{
  %param_0.4 = bf16[2,64,64,320]{{3,2,1,0}} parameter(0)
  %param_1.4 = bf16[2,64,64,320]{{3,2,1,0}} parameter(1)
  ROOT %concatenate.2 = bf16[2,64,64,640]{{3,2,1,0}} concatenate(%param_0.4, %param_1.4), dimensions={{3}}, metadata={{op_name="jit(loop)/while/body/closed_call/UNet2DConditionModel/up_blocks_3/concatenate"}}
}}

%fused_add (param_0.5: s32[]) -> s32[] {{
  %param_0.5 = s32[] parameter(0)
  %constant.2 = s32[] constant(1)
  ROOT %add.2 = s32[] add(%param_0.5, %constant.2), metadata={{op_name="jit(loop)/while/body/add"}}
}}

%fused_compare (param_0.6: s32[]) -> pred[] {{
  %param_0.6 = s32[] parameter(0)
  %constant.3 = s32[] constant(5)
  ROOT %compare.1 = pred[] compare(%param_0.6, %constant.3), direction=LT, metadata={{op_name="jit(loop)/while/cond/lt"}}
}}

%region_body (arg_tuple.1: (s32[], bf16[2,64,64,320], bf16[960,320])) -> (s32[], bf16[2,64,64,320], bf16[960,320]) {{
  %arg_tuple.1 = (s32[], bf16[2,64,64,320]{{3,2,1,0}}, bf16[960,320]{{1,0}}) parameter(0)
  %get-tuple-element.2 = s32[] get-tuple-element(%arg_tuple.1), index=0
  %get-tuple-element.3 = bf16[2,64,64,320]{{3,2,1,0}} get-tuple-element(%arg_tuple.1), index=1
  %get-tuple-element.4 = bf16[960,320]{{1,0}} get-tuple-element(%arg_tuple.1), index=2
  %bitcast.1 = bf16[2,4096,32,10]{{3,2,1,0}} bitcast(%get-tuple-element.3)
  %input_reduce_fusion.1 = (f32[2,32]{{1,0}}, f32[2,32]{{1,0}}) fusion(%bitcast.1), kind=kInput, calls=%fused_reduce, metadata={{op_name="{BODY}/resnets_0/norm1/reduce_sum"}}
  %constant.4 = bf16[3,3,320,320]{{3,2,1,0}} constant({{...}})
  %call.1 = bf16[2,64,64,320]{{3,2,1,0}} call(%get-tuple-element.3, %constant.4), to_apply=%command_buffer
  %cudnn-conv-bias-activation.2 = (bf16[2,64,64,320]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%call.1, %constant.4), window={{size=3x3 pad=1_1x1_1}}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBiasActivationForward", metadata={{op_name="{BODY}/resnets_0/conv2/conv_general_dilated"}}
  %get-tuple-element.5 = bf16[2,64,64,320]{{3,2,1,0}} get-tuple-element(%cudnn-conv-bias-activation.2), index=0
  %bitcast.2 = bf16[2,4096,8,40]{{3,2,1,0}} bitcast(%get-tuple-element.5)
  %input_transpose_fusion.1 = bf16[2,8,4096,40]{{3,2,1,0}} fusion(%bitcast.2), kind=kInput, calls=%fused_transpose, metadata={{op_name="{BODY}/attentions_0/transformer_blocks_0/attn1/transpose"}}
  %concatenate.1 = bf16[320,960]{{1,0}} concatenate(%get-tuple-element.4, %get-tuple-element.4, %get-tuple-element.4), dimensions={{1}}
  %bitcast.3 = bf16[8192,320]{{1,0}} bitcast(%get-tuple-element.5)
  %cublas-gemm.1 = (bf16[8192,960]{{1,0}}, s8[4194304]{{0}}) custom-call(%bitcast.3, %concatenate.1), custom_call_target="__cublas$gemm", metadata={{op_name="{BODY}/attentions_0/transformer_blocks_0/attn1/to_q/dot_general"}}
  %cublas-lt-matmul.2 = (bf16[8192,320]{{1,0}}, s8[4194304]{{0}}) custom-call(%bitcast.3, %get-tuple-element.4), custom_call_target="__cublas$lt$matmul", metadata={{op_name="{BODY}/attentions_0/transformer_blocks_0/ff/net_2/dot_general"}}
  %dot_product_attention_fwd.1 = (bf16[16,1,4096,40]{{3,1,2,0}}, u8[0]{{0}}) custom-call(%input_transpose_fusion.1, %input_transpose_fusion.1, %input_transpose_fusion.1), custom_call_target="__cudnn$fmhaSoftmax", metadata={{op_name="{BODY}/attentions_0/transformer_blocks_0/attn1/dot_product_attention_fwd"}}
  %loop_concatenate_fusion.1 = bf16[2,64,64,640]{{3,2,1,0}} fusion(%get-tuple-element.5, %call.1), kind=kLoop, calls=%fused_concatenate, metadata={{op_name="jit(loop)/while/body/closed_call/UNet2DConditionModel/up_blocks_3/concatenate"}}
  %copy.1 = bf16[2,64,64,320]{{2,1,3,0}} copy(%get-tuple-element.5)
  %loop_add_fusion.1 = s32[] fusion(%get-tuple-element.2), kind=kLoop, calls=%fused_add, metadata={{op_name="jit(loop)/while/body/add"}}
  ROOT %tuple.2 = (s32[], bf16[2,64,64,320]{{3,2,1,0}}, bf16[960,320]{{1,0}}) tuple(%loop_add_fusion.1, %get-tuple-element.5, %get-tuple-element.4)
}}

%region_cond (arg_tuple.2: (s32[], bf16[2,64,64,320], bf16[960,320])) -> pred[] {{
  %arg_tuple.2 = (s32[], bf16[2,64,64,320]{{3,2,1,0}}, bf16[960,320]{{1,0}}) parameter(0)
  %get-tuple-element.6 = s32[] get-tuple-element(%arg_tuple.2), index=0
  ROOT %loop_compare_fusion = pred[] fusion(%get-tuple-element.6), kind=kLoop, calls=%fused_compare, metadata={{op_name="jit(loop)/while/cond/lt"}}
}}

ENTRY %main.1 (x.1: bf16[2,64,64,320], w.1: f32[960,320]) -> bf16[2,64,64,320] {{
  %x.1 = bf16[2,64,64,320]{{3,2,1,0}} parameter(0)
  %w.1 = f32[960,320]{{1,0}} parameter(1)
  %constant.5 = s32[] constant(0)
  %loop_convert_fusion.1 = bf16[960,320]{{1,0}} fusion(%w.1), kind=kLoop, calls=%fused_convert, metadata={{op_name="jit(loop)/convert_element_type"}}
  %tuple.3 = (s32[], bf16[2,64,64,320]{{3,2,1,0}}, bf16[960,320]{{1,0}}) tuple(%constant.5, %x.1, %loop_convert_fusion.1)
  %while.1 = (s32[], bf16[2,64,64,320]{{3,2,1,0}}, bf16[960,320]{{1,0}}) while(%tuple.3), condition=%region_cond, body=%region_body
  ROOT %get-tuple-element.7 = bf16[2,64,64,320]{{3,2,1,0}} get-tuple-element(%while.1), index=1
}}
"""  # noqa: E501 (HLO lines as XLA prints them)

# By hand from the module above: kernel -> (profile class, in the loop).
EXPECTED = {
    "loop_convert_fusion.1": ("elementwise (kLoop)", False),  # hoisted weight convert: runs once
    "input_reduce_fusion.1": ("reduction (kInput)", True),
    "loop_multiply_fusion.1": ("elementwise (kLoop)", True),  # inside the command buffer
    "cudnn-conv.1": ("convolution", True),  # inside the command buffer
    "cudnn-conv-bias-activation.2": ("convolution", True),
    "input_transpose_fusion.1": ("transpose / copy", True),  # kInput, but its hero is a transpose
    "concatenate.1": ("concatenate", True),
    "cublas-gemm.1": ("matrix product", True),
    "cublas-lt-matmul.2": ("matrix product", True),
    "dot_product_attention_fwd.1": ("attention (cuDNN)", True),
    "loop_concatenate_fusion.1": ("concatenate", True),
    "copy.1": ("transpose / copy", True),
    "loop_add_fusion.1": ("elementwise (kLoop)", True),
    "loop_compare_fusion": ("elementwise (kLoop)", True),  # the loop condition runs every step too
}


@pytest.fixture(scope="module")
def gkc():
    return bench_scripts.load("gpu_kernel_count")


def test_parse_finds_every_computation_and_the_entry(gkc):
    comps, entry = gkc.parse_hlo(HLO)
    assert entry == "main.1"
    assert set(comps) == {
        "region_add",
        "fused_convert",
        "fused_reduce",
        "fused_silu",
        "command_buffer",
        "fused_transpose",
        "fused_concatenate",
        "fused_add",
        "fused_compare",
        "region_body",
        "region_cond",
        "main.1",
    }
    body = {ins["name"]: ins for ins in comps["region_body"]}
    assert len(body) == 21
    assert body["cublas-gemm.1"]["opcode"] == "custom-call"
    assert body["cublas-gemm.1"]["shape"] == "(bf16[8192,960]{1,0}, s8[4194304]{0})"
    assert body["input_reduce_fusion.1"]["opcode"] == "fusion"
    assert [ins["opcode"] for ins in comps["main.1"]] == [
        "parameter",
        "parameter",
        "constant",
        "fusion",
        "tuple",
        "while",
        "get-tuple-element",
    ]


def test_kernels_are_the_launching_instructions_of_what_the_entry_runs(gkc):
    comps, entry = gkc.parse_hlo(HLO)
    found = {ins["name"]: in_loop for ins, in_loop in gkc.kernels(comps, entry)}
    assert found == {name: in_loop for name, (_, in_loop) in EXPECTED.items()}


def test_each_kernel_gets_its_profile_class(gkc):
    comps, entry = gkc.parse_hlo(HLO)
    for ins, _ in gkc.kernels(comps, entry):
        fused = gkc._fused(comps, ins) if ins["opcode"] == "fusion" else []
        cls, _ = gkc.classify(ins, fused)
        assert cls == EXPECTED[ins["name"]][0], ins["name"]


def test_count_tallies_the_loop_once_per_step(gkc):
    result = gkc.count(HLO)
    assert result["kernels"] == 13
    assert result["outside_loop"] == 1
    assert result["by_class"] == {
        "convolution": 2,
        "matrix product": 2,
        "elementwise (kLoop)": 3,
        "reduction (kInput)": 1,
        "attention (cuDNN)": 1,
        "transpose / copy": 2,
        "concatenate": 2,
    }
    # the profile's order, classes with no kernel left out
    assert list(result["by_class"]) == [c for c in gkc.CLASSES if c in result["by_class"]]
    details = result["by_class_detail"]
    assert details["convolution | __cudnn$convForward"] == 1
    assert details["convolution | __cudnn$convBiasActivationForward"] == 1
    assert details["attention (cuDNN) | __cudnn$fmhaSoftmax"] == 1
    assert details["reduction (kInput) | kInput reduce"] == 1
    assert details["transpose / copy | kInput transpose"] == 1
    roles = result["by_class_role"]
    assert roles["reduction (kInput) | GroupNorm"] == 1
    assert roles["elementwise (kLoop) | SiLU"] == 1
    assert roles["transpose / copy | attention head split/merge"] == 1
    assert roles["concatenate | merged weights (XLA dot merger)"] == 1  # the gemm's operand
    assert roles["concatenate | skip concatenate"] == 1
    assert result["by_name"]["input_reduce_fusion"] == 1
    assert sum(result["by_name"].values()) == 13
    rows = {r["kernel"]: r for r in result["rows"]}
    assert rows["cudnn-conv.1"]["shape"] == "(bf16[2,64,64,320], u8[0])"  # layouts dropped, the tuple whole
    assert rows["input_reduce_fusion.1"]["shape"] == "(f32[2,32], f32[2,32])"
    assert rows["copy.1"]["shape"] == "bf16[2,64,64,320]"
    assert rows["loop_convert_fusion.1"]["in_loop"] is False


def test_without_a_loop_every_kernel_is_counted(gkc):
    # the body's kernels as a single call: the entry runs the command buffer directly
    single = HLO.replace(
        "%while.1 = (s32[], bf16[2,64,64,320]{3,2,1,0}, bf16[960,320]{1,0}) while(%tuple.3), "
        "condition=%region_cond, body=%region_body",
        "%while.1 = bf16[2,64,64,320]{3,2,1,0} call(%x.1, %constant.5), to_apply=%command_buffer",
    )
    assert single != HLO
    result = gkc.count(single)
    assert result["outside_loop"] == 0
    assert result["kernels"] == 3  # the weight convert, and the SiLU and convolution of the command buffer
    assert result["by_class"] == {"convolution": 1, "elementwise (kLoop)": 2}


def test_a_module_without_entry_is_refused(gkc):
    with pytest.raises(ValueError, match="ENTRY"):
        gkc.parse_hlo(HLO.replace("ENTRY %main.1", "%main.1"))

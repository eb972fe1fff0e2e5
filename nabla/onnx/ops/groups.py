"""The op groups of the ONNX sharding formalism (unary, broadcast n-ary, reduction, matmul-like) and the
conv/pool/norm group, by ONNX op type, for the checker and the report; ``group_of`` names an op's group."""

from __future__ import annotations

UNARY = frozenset("""Abs Acos Acosh Asin Asinh Atan Atanh Cast Ceil Cos Cosh Dropout Erf Exp Floor Identity IsInf
IsNaN Log Neg Not Reciprocal Round Sigmoid Sign Sin Sinh Tan Tanh ConstantOfShape Relu Sqrt LeakyRelu Elu Selu
Celu ThresholdedRelu HardSigmoid HardSwish Softplus Softsign Mish Swish Gelu Shrink CastLike Clip""".split())
BROADCAST = frozenset("""Add And BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Equal Greater Less Mod Mul Or
Pow Sub Sum Where Xor Div GreaterOrEqual LessOrEqual Max Min Mean PRelu""".split())
REDUCTION = frozenset("""ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 ReduceSumSquare
ReduceLogSum ReduceLogSumExp ArgMax ArgMin""".split())
MATMUL = frozenset({"MatMul", "Gemm", "Einsum"})
WINDOWED = frozenset("""AveragePool GlobalAveragePool GlobalLpPool GlobalMaxPool LpPool MaxPool MaxRoiPool Conv
ConvInteger ConvTranspose DeformConv InstanceNormalization LpNormalization LayerNormalization BatchNormalization
LRN""".split())  # the ONNX formalism draft's pooling and convolution group, with the norms real models use

GROUPS = {"unary elementwise": UNARY, "broadcast n-ary": BROADCAST, "reduction": REDUCTION,
          "matmul/gemm/einsum": MATMUL, "conv/pool/norm": WINDOWED}


def group_of(op_type: str) -> str:
    """The op group (the ONNX sharding formalism's, and conv/pool/norm) of an ONNX op type; ``"other"`` for the rest."""
    for name, ops in GROUPS.items():
        if op_type in ops:
            return name
    return "other"

"""hwkv-ascend: the Huawei Ascend backend of hwkv. Importing it never imports torch_npu."""

__version__ = "0.1.0"

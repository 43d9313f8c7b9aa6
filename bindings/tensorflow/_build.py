"""Builds (once per TensorFlow version, shoal/_compiled.py) and loads the TensorFlow kernel
library, compiled against the TensorFlow installed when it is first needed."""
from pathlib import Path

import tensorflow as tf

from shoal import _compiled

SOURCE = Path(__file__).resolve().parent / "shoal_tf_ops.cc"


def load():
    """The loaded op library (tf.load_op_library), building it first if needed."""
    pkg = _compiled.PKG
    flags = [*tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags(), f"-L{pkg}", "-lshoal",
             f"-Wl,-rpath,{pkg}"]
    return tf.load_op_library(str(_compiled.library(f"tf-{tf.__version__}", SOURCE, "libshoal_tf.so", flags,
                                                    f"the TensorFlow kernels for TensorFlow {tf.__version__}")))

"""Lion (Keras 3): c = b1*m + (1-b1)*g;  p <- p*(1 - lr*wd) - lr*sign(c);  m <- b2*m + (1-b2)*g."""

from __future__ import annotations

import numpy as np

from optimizers.keras.lion import Lion
from tests.optimizers.keras.helpers import apply, slots, variable64


def test_hand_computed_steps() -> None:
    variable = variable64([1.0, -2.0, 3.0])
    optimizer = Lion(learning_rate=0.5, beta_1=0.75, beta_2=0.5, weight_decay=0.5)

    # Step 1, m = 0: c = 0.25 * g, sign [1, -1, 0]; p * 0.75 = [0.75, -1.5, 2.25]
    apply(optimizer, variable, [0.5, -1.0, 0.0])
    np.testing.assert_array_equal(variable.numpy(), [0.25, -1.0, 2.25])
    np.testing.assert_array_equal(slots(optimizer)[0], [0.25, -0.5, 0.0])  # 0.5 * g

    # Step 2: c = 0.75 * m + 0.25 * g = [0.125, -0.125, 0.25]: the momentum outvotes
    # the first two gradients' signs; p * 0.75 = [0.1875, -0.75, 1.6875]
    apply(optimizer, variable, [-0.25, 0.25, 1.0])
    np.testing.assert_array_equal(variable.numpy(), [-0.3125, -0.25, 1.1875])
    np.testing.assert_array_equal(slots(optimizer)[0], [0.0, -0.125, 0.5])

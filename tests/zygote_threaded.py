"""Imported by a zygote in tests/test_jax_zygote.py: starts a thread, so the zygote must refuse."""

import threading
import time

threading.Thread(target=time.sleep, args=(60,), daemon=True).start()

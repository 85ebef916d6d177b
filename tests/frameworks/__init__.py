"""Training scripts written as users of PyTorch Lightning and Accelerate write them; tests/test_frameworks.py runs them."""

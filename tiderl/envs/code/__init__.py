"""The code environment (write a function, test it in a sandbox) and the sandbox itself."""

"""`forge eval`: a policy's pass@1, pass@k and pass^k on a task file, and a significance test between two runs."""

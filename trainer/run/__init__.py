"""The run: the train loop, several processes joining, stop signals, host memory."""

"""Support code the tests of several folders share (not tests themselves)."""

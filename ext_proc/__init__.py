"""ext_proc"""

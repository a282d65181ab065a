"""placeholder"""
def add_download(sub):
    pass

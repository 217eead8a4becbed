import json,pandas as pd
pd.set_option('display.width',250); pd.set_option('display.max_columns',40); pd.set_option('display.max_colwidth',40); pd.set_option('display.max_rows',500)
P=pd.read_csv('data/published.csv',comment='#')
P['row']=P.index+2
d=json.load(open('data/published-cv.json'))
V=pd.DataFrame(d['values'])
M=V.merge(P.drop(columns=['source','engine','gpu','model']),on='row')

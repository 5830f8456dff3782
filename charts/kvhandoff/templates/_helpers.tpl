{{/* image is the reference of one of kvhandoff's images. */}}
{{- define "kvhandoff.image" -}}
{{ .root.Values.image.registry }}/{{ .name }}:{{ .root.Values.image.tag | default .root.Chart.AppVersion }}
{{- end }}

{{/* pullPolicy is the image pull policy line, when one is set. */}}
{{- define "kvhandoff.pullPolicy" -}}
{{- with .Values.image.pullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}
{{- end }}

{{/* nodeAffinity is a node component's affinity: its own, or the instance-type rule. */}}
{{- define "kvhandoff.nodeAffinity" -}}
{{- if .own }}
nodeAffinity:
  {{- toYaml .own | nindent 2 }}
{{- else }}
nodeAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    nodeSelectorTerms:
    - matchExpressions:
      - key: node.kubernetes.io/instance-type
        operator: In
        values: {{ toJson .root.Values.instanceTypes }}
{{- end }}
{{- end }}
